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
from common.gguf_file import GgufFile, hold_gguf, read_gguf


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

    class SlowParse(GgufFile):
        def __init__(self, *args, **kwargs) -> None:
            parses.append(1)
            time.sleep(0.2)  # a parse long enough for the other thread to ask meanwhile
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_file, "GgufFile", SlowParse)
    readers: list[GgufFile] = []
    threads = [threading.Thread(target=lambda: readers.append(read_gguf(path))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(readers) == 2 and readers[0] is readers[1]
    assert len(parses) == 1


def test_nothing_is_held_for_a_model_directory(tmp_path):
    assert hold_gguf(tmp_path) is None


def readers_view(path):
    """What gguf's own reader makes of the file: the oracle."""
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}, reader.tensors


def assert_read_as_gguf_reads(path) -> GgufFile:
    parsed = GgufFile(path)
    metadata, tensors = readers_view(path)
    assert parsed.metadata == metadata
    assert list(parsed.metadata) == list(metadata)  # in the file's order
    for key, value in metadata.items():  # the same Python types, not only equal values
        assert type(parsed.metadata[key]) is type(value), key
    assert len(parsed.tensors) == len(tensors)
    for ours, theirs in zip(parsed.tensors, tensors, strict=True):
        assert (ours.name, ours.tensor_type) == (theirs.name, theirs.tensor_type)
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)
    return parsed


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_and_tensor_kind_reads_as_gguf_s_reader_reads_it(tmp_path, endian):
    target = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(target), "llama", endianess=endian)
    writer.add_uint8("u8", 200)
    writer.add_int8("i8", -100)
    writer.add_uint16("u16", 60000)
    writer.add_int16("i16", -30000)
    writer.add_uint32("u32", 4_000_000_000)
    writer.add_int32("i32", -2_000_000_000)
    writer.add_uint64("u64", 2**63 + 5)
    writer.add_int64("i64", -(2**62))
    writer.add_float32("f32", 1e-5)
    writer.add_float64("f64", 1e-300)
    writer.add_bool("yes", True)
    writer.add_string("text", "héllo ✓")
    writer.add_string("empty", "")
    writer.add_array("tokens", ["a", "bé", "", "<|im_end|>"])
    writer.add_array("scores", [0.5, -1.25, 3.0])
    writer.add_array("types", [1, 2, 3])
    writer.add_array("flags", [True, False])
    writer.add_array("none", [])
    writer.add_uint32("general.alignment", 64)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    blocks = rng.integers(0, 255, (4, 2 * 34), dtype=np.uint8)  # 4 rows of two Q8_0 blocks
    writer.add_tensor("q8", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parsed = assert_read_as_gguf_reads(target)
    assert parsed.metadata["text"] == "héllo ✓" and parsed.metadata["u64"] == 2**63 + 5


def test_the_default_model_s_file_reads_as_gguf_s_reader_reads_it():
    """49,152 tokens, their merges and 272 tensors, most of them 4-bit blocks."""
    from common.default_model import gguf_path

    assert_read_as_gguf_reads(gguf_path())


def test_what_is_not_a_gguf_file_or_is_cut_short_is_refused_naming_the_file(path, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match=r"other\.gguf' is not a GGUF file"):
        GgufFile(other)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"cut\.gguf': its metadata is cut short or corrupt"):
        GgufFile(cut)
    data = path.read_bytes()
    headless = tmp_path / "headless.gguf"  # the metadata whole, the tensor's data gone
    headless.write_bytes(data[: len(data) - 4 * 8 * 4])
    with pytest.raises(ValueError, match=r"tensor 'token_embd\.weight' runs past the file's end"):
        GgufFile(headless)
