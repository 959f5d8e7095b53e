"""The disk tier: KV blocks as files in `--kv-cache-dir`, found again by a restarted engine.

Layout: DIR/<fingerprint>/<chained block hash, hex>.kv, one file per block; with tensor
parallelism each rank writes its own shard of the KV heads, DIR/<fingerprint>/rank<r>/<hash>.kv.
The fingerprint names everything a block's bytes depend on (model files, dtype, block size,
tensor-parallel size, quantization, KV shape per rank), so engines of another model or layout
share the directory without ever reading each other's blocks; a directory holding only other
fingerprints means starting cold, and their files are left untouched. A file is a header
(magic, JSON: fingerprint, rank, block hash, payload length, CRC-32 of the payload) and the
payload (the block's K/V bytes, this rank's heads, in the pool's dtype). Files are written by a
background thread into a temporary name and renamed into place (atomic on POSIX), so an engine
sharing the directory, or one restarted after `kill -9`, never sees half a file; a file that
fails any check on reading (truncated, corrupt, foreign) is skipped with one warning and never
served. Disk use is bounded: past the bound the oldest files (by modification time; a hit
refreshes it) are deleted first, those of pinned blocks (this engine's pins, `pinned`) last.

Torch-free: payloads are bytes. This module never decides which blocks to keep (engine.kv_tiers.book
does) and never touches KV tensors (engine.kv_tiers.store does).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"FOLIOKV1"
SUFFIX = ".kv"
# Writes waiting for the writer thread beyond this many are dropped: the tier is a cache.
MAX_QUEUED_WRITES = 1024


def fingerprint(identity: dict[str, object]) -> str:
    """A short stable name of what KV bytes depend on (see the module docstring)."""
    text = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def model_identity(model_path: Path) -> str:
    """A hash of the model's files as they are: config.json and, of every weight file, its
    name, size and first and last 64 KiB (cheap on gigabytes, and random weights differ)."""
    digest = hashlib.sha256()
    files = [model_path] if model_path.is_file() else sorted(model_path.iterdir())
    for path in files:
        if path.name != "config.json" and path.suffix not in (".safetensors", ".gguf"):
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(65536))
            f.seek(max(0, size - 65536))
            digest.update(f.read(65536))
    return digest.hexdigest()


@dataclass
class _File:
    size: int
    mtime: float


class DiskTier:
    def __init__(
        self,
        directory: str,
        max_bytes: int,
        block_bytes: int,
        identity: dict,
        rank: int | None = None,
        ranks: int = 1,
    ) -> None:
        """Start-up: ValueError in one line naming the flag when the directory cannot be used or
        the bound is below one block; a directory of other fingerprints only is logged (cold
        start, files untouched). `rank` of `ranks`: this tensor-parallel rank's shard files
        (None: one rank, no subdirectory), holding 1/ranks of `max_bytes` and of every block's
        `block_bytes` (both counted over all ranks)."""
        self.root = Path(directory)
        self.rank = rank
        if max_bytes < block_bytes:
            raise ValueError(
                f"--kv-cache-dir-gib {max_bytes / 1024**3:.6g} is below one KV block "
                f"({block_bytes} bytes); raise it"
            )
        max_bytes //= ranks
        block_bytes //= ranks
        self.fingerprint = fingerprint(identity)
        home = self.root / self.fingerprint
        self.dir = home if rank is None else home / f"rank{rank}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.dir, prefix=".probe-"):
                pass
        except OSError as error:
            raise ValueError(
                f"--kv-cache-dir {directory!r} is not a writable directory: "
                f"{error.strerror or error}"
            ) from None
        self.max_bytes = max_bytes
        self.block_bytes = block_bytes
        (home / "fingerprint.json").write_text(json.dumps(identity, sort_keys=True))
        self._lock = threading.Lock()
        # Whether a hash is pinned (engine.kv_tiers.book.TierBook.track_pins), asked from the
        # writer thread: a dict lookup, atomic under the GIL.
        self.pinned: Callable[[bytes], bool] = lambda block_hash: False
        # The index: our fingerprint's files (this engine's and others' found on the way).
        self._files: dict[bytes, _File] = {}
        self._bad: set[bytes] = set()
        self._scan()
        others = [p.name for p in self.root.iterdir() if p.is_dir() and p != home]
        if others and not self._files:
            logger.warning(
                "--kv-cache-dir %s: holds KV blocks of another model/dtype/block size/TP/"
                "quantization only (fingerprints %s, this engine's %s): starting cold, their "
                "files left untouched",
                directory,
                ", ".join(sorted(others)),
                self.fingerprint,
            )
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(MAX_QUEUED_WRITES)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(f.size for f in self._files.values())

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _scan(self) -> None:
        files = {}
        for entry in os.scandir(self.dir):
            name = entry.name
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            try:
                block_hash = bytes.fromhex(name[: -len(SUFFIX)])
                stat = entry.stat()
            except (ValueError, OSError):
                continue  # not ours, or deleted meanwhile
            files[block_hash] = _File(stat.st_size, stat.st_mtime)
        with self._lock:
            # Files still queued for the writer stay known.
            queued = {h: f for h, f in self._files.items() if f.mtime == float("inf")}
            self._files = files | queued

    def knows(self, block_hash: bytes) -> bool:
        """Whether a file of this block is (as far as the index knows) written or queued."""
        with self._lock:
            return block_hash in self._files

    def forget(self, block_hash: bytes) -> None:
        """Drop a block from the index (its file stays until overwritten): another rank lacks
        its shard, so the block is written again, on every rank, when next registered."""
        with self._lock:
            self._files.pop(block_hash, None)

    def read(self, block_hash: bytes) -> bytes | None:
        """The block's payload, verified; None when there is no such file or it fails a check
        (warned once per file)."""
        if block_hash in self._bad:
            return None
        path = self._path(block_hash)
        try:
            with path.open("rb") as f:
                data = f.read()
        except OSError:
            return None
        payload = self._verify(block_hash, data)
        if payload is None:
            self._bad.add(block_hash)
            with self._lock:
                self._files.pop(block_hash, None)
            logger.warning("--kv-cache-dir: skipping %s (truncated, corrupt or foreign)", path)
            return None
        try:
            os.utime(path)  # a hit is recent: the bound deletes it last
            now = path.stat().st_mtime
        except OSError:
            now = 0.0
        with self._lock:
            self._files[block_hash] = _File(len(data), now)
        return payload

    def _verify(self, block_hash: bytes, data: bytes) -> bytes | None:
        if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
            return None
        (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4 + header_len
        try:
            header = json.loads(data[len(MAGIC) + 4 : start])
        except ValueError:
            return None
        payload = data[start:]
        if (
            not isinstance(header, dict)
            or header.get("fingerprint") != self.fingerprint
            or header.get("rank", 0) != (self.rank or 0)
            or header.get("hash") != block_hash.hex()
            or header.get("nbytes") != len(payload)
            or len(payload) != self.block_bytes
            or header.get("crc32") != zlib.crc32(payload)
        ):
            return None
        return payload

    def write(self, block_hash: bytes, payload: bytes) -> None:
        """Queue the block's file (written by the writer thread); dropped when the queue is
        full."""
        with self._lock:
            if block_hash in self._files:
                return
            self._files[block_hash] = _File(len(payload), float("inf"))  # queued: newest
        try:
            self._queue.put_nowait((block_hash, payload))
        except queue.Full:
            with self._lock:
                self._files.pop(block_hash, None)

    def drain(self) -> None:
        """Wait until every queued file is written (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except OSError as error:  # a full disk: the block stays uncached
                logger.warning("--kv-cache-dir: cannot write a block: %s", error)
                with self._lock:
                    self._files.pop(item[0], None)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "rank": self.rank or 0,
                "hash": block_hash.hex(),
                "nbytes": len(payload),
                "crc32": zlib.crc32(payload),
            }
        ).encode()
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
            os.replace(tmp, self._path(block_hash))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._bad.discard(block_hash)
        stat = self._path(block_hash).stat()
        with self._lock:
            self._files[block_hash] = _File(stat.st_size, stat.st_mtime)
            over = sum(f.size for f in self._files.values()) > self.max_bytes
        if over:
            self._evict()

    def _evict(self) -> None:
        """Delete the oldest files until within the bound, pinned blocks' last (files other
        engines wrote into this fingerprint's directory count too: the directory is scanned
        again first)."""
        self._scan()
        with self._lock:
            oldest = sorted(
                self._files.items(), key=lambda item: (self.pinned(item[0]), item[1].mtime)
            )
            total = sum(f.size for f in self._files.values())
            doomed = []
            for block_hash, file in oldest:
                if total <= self.max_bytes:
                    break
                total -= file.size
                doomed.append(block_hash)
                del self._files[block_hash]
        for block_hash in doomed:
            self._path(block_hash).unlink(missing_ok=True)
