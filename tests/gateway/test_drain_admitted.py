"""A drain refuses new work but not work admitted before it: a batch line its runner started
(gateway.batch.lines marks its task) is let finish when the gateway starts draining while it
runs, instead of being refused half-way and counted as one more attempt."""

from __future__ import annotations

import contextvars
from types import SimpleNamespace

import pytest

from common.errors import UnavailableError
from gateway.pipeline.generation import Gateway, mark_in_flight


def check(draining: bool) -> None:
    Gateway.check_available(SimpleNamespace(draining=draining))  # type: ignore[arg-type]


def test_a_drain_refuses_new_work_but_not_work_admitted_before_it():
    check(draining=False)
    with pytest.raises(UnavailableError, match="draining"):
        check(draining=True)

    def admitted_then_drained() -> None:
        mark_in_flight()
        check(draining=True)

    contextvars.copy_context().run(admitted_then_drained)
    # The mark stays with the task that set it: other work is still refused.
    with pytest.raises(UnavailableError, match="draining"):
        check(draining=True)
