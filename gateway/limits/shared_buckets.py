"""Rate-limit token buckets that the worker processes of one gateway share, so that a caller's
limit is the whole server's and not each worker's.

One limit's buckets live in one file that every worker maps (mmap); each operation reads,
updates and writes a bucket under an exclusive flock of that file, so a take is atomic across
processes. The file: a header (slots in use, u64), then SLOTS fixed records (a 16-byte BLAKE2b
digest of the caller, level f64, last refill f64), found by open addressing with linear probing;
an all-zero digest marks a free slot. Once MAX_TRACKED_CALLERS slots are in use, the buckets of
callers idle long enough to be full again are dropped (they carry no state) and the rest put
back. Times are time.monotonic(): CLOCK_MONOTONIC, one clock for every process of the machine.
The bucket arithmetic is rate_limit.TokenBucket's; this module only stores buckets. It never
decides admission and never talks to a service.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from gateway.limits.rate_limit import MAX_TRACKED_CALLERS, TokenBucket

# Twice the callers tracked: probe sequences stay short.
SLOTS = 2 * MAX_TRACKED_CALLERS
_HEADER = struct.Struct("<Q")
_RECORD = struct.Struct("<16sdd")
_FREE = bytes(16)
FILE_SIZE = _HEADER.size + SLOTS * _RECORD.size


class SharedBuckets:
    """One limit's buckets in the file `path` (made, empty, by the first process to open it)."""

    def __init__(self, path: Path, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._locked():
                if os.fstat(self._fd).st_size < FILE_SIZE:
                    os.ftruncate(self._fd, FILE_SIZE)  # zeros: every slot free
            self._map = mmap.mmap(self._fd, FILE_SIZE)
        except OSError:
            os.close(self._fd)
            raise

    @classmethod
    def in_directory(
        cls, directory: Path, name: str, rate: float, capacity: float
    ) -> SharedBuckets:
        """The buckets of the limit `name` in the workers' shared state directory."""
        return cls(directory / f"rate-limit-{name}.buckets", rate, capacity)

    def take(self, caller: str, amount: float, now: float) -> float:
        with self._locked():
            slot = self._find(_digest(caller), now, insert=True)
            assert slot is not None
            bucket = self._bucket(slot)
            wait = bucket.take(amount, now)
            self._store(slot, bucket)
        return wait

    def give_back(self, caller: str, amount: float, now: float) -> None:
        with self._locked():
            slot = self._find(_digest(caller), now, insert=False)
            if slot is None:
                return  # forgotten when full: it starts full again anyway
            bucket = self._bucket(slot)
            bucket.give_back(amount, now)
            self._store(slot, bucket)

    def __len__(self) -> int:
        count: int = _HEADER.unpack_from(self._map, 0)[0]
        return count

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    # -- the table (under the lock) ---------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _find(self, digest: bytes, now: float, insert: bool) -> int | None:
        """The slot of `digest`'s bucket; a new full bucket there if absent and `insert`."""
        start = int.from_bytes(digest[:8], "little") % SLOTS
        for probe in range(SLOTS):
            slot = (start + probe) % SLOTS
            held = self._map[self._offset(slot) : self._offset(slot) + 16]
            if held == digest:
                return slot
            if held == _FREE:
                if not insert:
                    return None
                if len(self) >= MAX_TRACKED_CALLERS and self._forget_full(now):
                    return self._find(digest, now, insert)  # the slots moved
                if len(self) >= SLOTS - 1:
                    # As many callers busy at once as the table has room for: all start over
                    # rather than one free slot, that ends every probe, going too.
                    self._map[:] = bytes(FILE_SIZE)
                    return self._find(digest, now, insert)
                _RECORD.pack_into(self._map, self._offset(slot), digest, self.capacity, now)
                _HEADER.pack_into(self._map, 0, len(self) + 1)
                return slot
        raise AssertionError("the bucket table is never full: it holds at most half its slots")

    def _forget_full(self, now: float) -> bool:
        """Drop the buckets that are full again; whether there were any."""
        kept = []
        for slot in range(SLOTS):
            digest, level, updated = _RECORD.unpack_from(self._map, self._offset(slot))
            if digest == _FREE:
                continue
            bucket = TokenBucket(self.rate, self.capacity, level, updated)
            bucket.refill(now)
            if bucket.level < bucket.capacity:
                kept.append((digest, bucket))
        if len(kept) == len(self):
            return False
        self._map[:] = bytes(FILE_SIZE)
        for digest, bucket in kept:
            moved = self._find(digest, now, insert=True)
            assert moved is not None
            self._store(moved, bucket)
        return True

    def _bucket(self, slot: int) -> TokenBucket:
        _, level, updated = _RECORD.unpack_from(self._map, self._offset(slot))
        return TokenBucket(self.rate, self.capacity, level, updated)

    def _store(self, slot: int, bucket: TokenBucket) -> None:
        struct.pack_into("<dd", self._map, self._offset(slot) + 16, bucket.level, bucket.updated)

    @staticmethod
    def _offset(slot: int) -> int:
        return _HEADER.size + slot * _RECORD.size


def _digest(caller: str) -> bytes:
    digest = hashlib.blake2b(caller.encode(), digest_size=16).digest()
    return digest if digest != _FREE else b"\x01" + digest[1:]
