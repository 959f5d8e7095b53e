"""common.heap: a service process's loaded objects out of the garbage collector's scans."""

from __future__ import annotations

import gc
import weakref

import pytest

from common import heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def garbage_cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the test process keeps collecting as it did


def test_a_process_that_does_not_own_its_heap_is_left_as_it_is(unfrozen, monkeypatch):
    monkeypatch.setattr(heap, "_owned", False)
    frozen = gc.get_freeze_count()
    heap.freeze_loaded_heap("test")
    assert gc.get_freeze_count() == frozen


def test_a_service_process_frees_loading_s_cycles_then_freezes_what_lives(unfrozen, monkeypatch):
    monkeypatch.setattr(heap, "_owned", True)
    gc.disable()  # no collection of the cycle but the one under test
    try:
        cycle = garbage_cycle()
        loaded = Node()
        assert cycle() is not None and any(o is loaded for o in gc.get_objects())
        heap.freeze_loaded_heap("test")
    finally:
        gc.enable()
    assert cycle() is None  # collected first: not kept for ever in the permanent generation
    assert gc.get_freeze_count() > 0
    assert not any(o is loaded for o in gc.get_objects())  # out of every later scan


def test_without_collect_loading_s_cycles_are_frozen_too(unfrozen, monkeypatch):
    """What a caller others wait on gets (compiled programs loaded while serving): no full
    collection, so what is garbage then is frozen with the rest."""
    monkeypatch.setattr(heap, "_owned", True)
    gc.disable()
    try:
        cycle = garbage_cycle()
        heap.freeze_loaded_heap("test", collect=False)
    finally:
        gc.enable()
    gc.collect()
    assert cycle() is not None
