"""common.gguf_file: one parse of a GGUF file's metadata while someone holds it."""

from __future__ import annotations

import os
import threading
import time
import weakref

import gguf
import numpy as np
import pytest

from common import gguf_file
from common.gguf_file import hold_gguf, read_gguf


@pytest.fixture
def path(tmp_path):
    target = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(target), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_a_held_reader_is_shared_then_freed_once_nobody_holds_it(path):
    held = hold_gguf(path)
    assert held is not None and read_gguf(path) is held
    assert read_gguf(str(path.parent / "." / path.name)) is held  # the same file, another name
    gone = weakref.ref(held)
    del held
    assert gone() is None  # freed at once: nothing of the parse stays in a serving process


def test_a_changed_file_is_parsed_again(path):
    held = read_gguf(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert read_gguf(path) is not held


def test_callers_at_once_share_one_parse(path, monkeypatch):
    """A second caller waits for the parse under way instead of parsing beside it."""
    parses = []

    class SlowReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs) -> None:
            parses.append(1)
            time.sleep(0.2)  # a parse long enough for the other thread to ask meanwhile
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_file, "GGUFReader", SlowReader)
    readers: list[gguf.GGUFReader] = []
    threads = [threading.Thread(target=lambda: readers.append(read_gguf(path))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(readers) == 2 and readers[0] is readers[1]
    assert len(parses) == 1


def test_nothing_is_held_for_a_model_directory(tmp_path):
    assert hold_gguf(tmp_path) is None
