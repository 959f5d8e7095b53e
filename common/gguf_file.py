"""A GGUF file's metadata and tensors, parsed once per loading phase.

gguf's own GGUFReader makes two numpy views per string of the metadata (every token and merge
of a vocabulary), then every value is read back through them: 3-5 s of Python for the default
model's 49,152 tokens and 48,900 merges on a 2-core VM, holding the interpreter lock, in each of
the engine, the tokenizer service and the gateway at start-up, and about 170 MB kept while the
reader lives. `GgufFile` reads the same format with `struct` straight into Python values (a
fraction of a second) and maps the tensors' data as the reader does (the same arrays: tests
compare the two on every value type, both byte orders and the default model's file).

Who owns a loading phase holds the file (`hold_gguf`) for its length: every `read_gguf` of it
inside shares that parse, and a second caller waits for a parse under way instead of running
its own beside it; once nobody holds it, it is freed. The tensors' data stays mapped, never
read here.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf's reader reads
DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.constants.GGUFValueType): the scalars' numpy types.
SCALAR_DTYPES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
SCALAR_DTYPES |= {11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# Tensor types stored as plain numbers (the rest: blocks, mapped as bytes per row).
PLAIN_TENSORS = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # the file's dimensions (innermost first), as gguf's reader gives them
    data: np.ndarray  # mapped: numbers in torch's order, or each row's blocks as bytes


class GgufFile:
    """`metadata`: every key's value as Python values (gguf's `field.contents()`, the header's
    GGUF.version, GGUF.tensor_count and GGUF.kv_count first); `tensors`: in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")
        buffer = self._buffer = memoryview(self._map.data)
        if bytes(buffer[:4]) != MAGIC:
            raise ValueError(
                f"{str(self.path)!r} is not a GGUF file (it starts {bytes(buffer[:4])!r})"
            )
        self._order: Literal["<", ">"] = "<"
        (version,) = struct.unpack_from("<I", buffer, 4)
        if version & 0xFFFF == 0:  # written for the other byte order
            self._order = ">" if sys.byteorder == "little" else "<"
            (version,) = struct.unpack_from(self._order + "I", buffer, 4)
        if version not in VERSIONS:
            raise ValueError(
                f"GGUF {str(self.path)!r}: version {version} is not read (only 2 and 3)"
            )
        tensor_count, kv_count = struct.unpack_from(self._order + "QQ", buffer, 8)
        self.metadata: dict[str, Any] = {
            "GGUF.version": version,
            "GGUF.tensor_count": tensor_count,
            "GGUF.kv_count": kv_count,
        }
        try:
            offset, infos = self._read_layout(kv_count, tensor_count)
        except (struct.error, UnicodeDecodeError) as error:
            raise ValueError(
                f"GGUF {str(self.path)!r}: its metadata is cut short or corrupt ({error})"
            ) from None
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(
                f"GGUF {str(self.path)!r}: general.alignment {alignment!r} is not a power of two"
            )
        data_start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(*info, data_start) for info in infos]
        if len({t.name for t in self.tensors}) < len(self.tensors):
            raise ValueError(f"GGUF {str(self.path)!r} names a tensor twice")

    def _read_layout(
        self, kv_count: int, tensor_count: int
    ) -> tuple[int, list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]]]:
        """The keys' values into `metadata`, then each tensor's (name, dimensions, type, start
        in the data); and the offset where they end."""
        offset = 24
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (kind,), offset = self._unpack("I", offset)
            self.metadata[key], offset = self._value(kind, offset)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (dims_count,), offset = self._unpack("I", offset)
            dims, offset = self._unpack("Q" * dims_count, offset)
            (kind, start), offset = self._unpack("IQ", offset)
            if kind not in GGML_QUANT_SIZES:
                raise ValueError(
                    f"GGUF {str(self.path)!r}: tensor {name!r} has type {kind}, not a GGML type"
                )
            infos.append((name, dims, GGMLQuantizationType(kind), start))
        return offset, infos

    def _unpack(self, formats: str, offset: int) -> tuple[tuple[Any, ...], int]:
        layout = struct.Struct(self._order + formats)
        return layout.unpack_from(self._buffer, offset), offset + layout.size

    def _string(self, offset: int) -> tuple[str, int]:
        (string,), offset = self._strings(1, offset)
        return string, offset

    def _strings(self, count: int, offset: int) -> tuple[list[str], int]:
        """`count` strings in a row (an array's: a vocabulary's tokens and merges are about
        100,000), their lengths' layout made once: the default model's metadata in 0.07 s,
        against 0.13 s with a layout made per string."""
        length_at = struct.Struct(self._order + "Q").unpack_from
        buffer, strings = self._buffer, []
        for _ in range(count):
            (length,) = length_at(buffer, offset)
            offset += 8
            strings.append(str(buffer[offset : offset + length], "utf-8"))
            offset += length
        return strings, offset

    def _value(self, kind: int, offset: int) -> tuple[Any, int]:
        if kind == STRING:
            return self._string(offset)
        if kind == ARRAY:
            (item_kind, count), offset = self._unpack("IQ", offset)
            if item_kind == STRING:
                return self._strings(count, offset)
            if item_kind == ARRAY:
                items = []
                for _ in range(count):
                    item, offset = self._value(item_kind, offset)
                    items.append(item)
                return items, offset
            layout = self._scalar(item_kind)
            values = np.frombuffer(self._buffer, layout.newbyteorder(self._order), count, offset)
            return values.tolist(), offset + count * layout.itemsize
        value = np.frombuffer(self._buffer, self._scalar(kind).newbyteorder(self._order), 1, offset)
        return value.tolist()[0], offset + value.itemsize

    def _scalar(self, kind: int) -> np.dtype:
        if kind not in SCALAR_DTYPES:
            raise ValueError(f"GGUF {str(self.path)!r}: value type {kind} is not a GGUF type")
        return np.dtype(SCALAR_DTYPES[kind])

    def _tensor(
        self,
        name: str,
        dims: tuple[int, ...],
        tensor_type: GGMLQuantizationType,
        start: int,
        data_start: int,
    ) -> GgufTensor:
        count = math.prod(dims)
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        shape = tuple(reversed(dims))
        dtype: np.dtype = np.dtype(PLAIN_TENSORS.get(tensor_type, np.uint8))
        if tensor_type not in PLAIN_TENSORS:
            count = count * block_bytes // block
            shape = quant_shape_to_byte_shape(shape, tensor_type)
        begin = data_start + start
        if begin + count * dtype.itemsize > len(self._map):
            raise ValueError(f"GGUF {str(self.path)!r}: tensor {name!r} runs past the file's end")
        data = self._map[begin : begin + count * dtype.itemsize].view(
            dtype.newbyteorder(self._order)
        )
        return GgufTensor(name, tensor_type, np.array(dims, dtype=np.uint64), data.reshape(shape))


_parsing = threading.Lock()
# (file, its modification time) -> its parse, while held somewhere.
_held: weakref.WeakValueDictionary[tuple[Path, int], GgufFile] = weakref.WeakValueDictionary()


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (rather than a Hugging Face directory)."""
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


def hold_gguf(path: str | Path) -> GgufFile | None:
    """What a loading phase keeps for its length (None where `path` is no GGUF file): the
    parse every read_gguf of the file then shares."""
    return read_gguf(path) if is_gguf(path) else None


def read_gguf(path: str | Path) -> GgufFile:
    """The file's parse: the one already held for the unchanged file, else a new one."""
    path = Path(path).resolve()
    key = (path, path.stat().st_mtime_ns)
    with _parsing:
        parsed = _held.get(key)
        if parsed is None:
            parsed = _held[key] = GgufFile(path)
        return parsed
