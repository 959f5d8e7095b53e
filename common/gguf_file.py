"""One parsed reader per GGUF file in a process, while someone holds it.

gguf's GGUFReader parses a file's whole metadata in Python, holding the interpreter lock (3-5 s
for the default model's vocabulary and merges on a 2-core VM), and the parsed reader takes about
170 MB. An engine reads one file for its config, its tensors' layout, its weights and structured
output's tokenizer (the last in a thread of its own, while the model loads): whoever owns such a
phase holds the reader (`read_gguf`) for its length, every read inside it shares that reader,
and a second caller waits for a parse under way instead of running its own beside it. Once
nobody holds it the reader is freed: a served process keeps no parsed metadata. The reader maps
the tensors' data; this module never reads it.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

from gguf import GGUFReader

_parsing = threading.Lock()
# (file, its modification time) -> its reader, while held somewhere.
_held: weakref.WeakValueDictionary[tuple[Path, int], GGUFReader] = weakref.WeakValueDictionary()


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (rather than a Hugging Face directory)."""
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


def hold_gguf(path: str | Path) -> GGUFReader | None:
    """What a loading phase keeps for its length (None where `path` is no GGUF file): the
    reader every read_gguf of the file then shares."""
    return read_gguf(path) if is_gguf(path) else None


def read_gguf(path: str | Path) -> GGUFReader:
    """The file's reader (memory-mapped): the one already held for the unchanged file, else a
    new parse."""
    path = Path(path).resolve()
    key = (path, path.stat().st_mtime_ns)
    with _parsing:
        reader = _held.get(key)
        if reader is None:
            reader = _held[key] = GGUFReader(path)
        return reader
