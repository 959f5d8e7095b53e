"""The tier moves rank 0 sends the other tensor-parallel ranks, as plain int64 arrays.

Rank 0 keeps the tiers' book (engine.kv_tiers.book) beside the scheduler; every rank keeps its
own shard of the KV heads in its own host tier and its own disk files (engine.kv_tiers.store).
So that every rank moves the same blocks at the same point of the step sequence, rank 0 sends
what the book decides through the group's broadcast (engine.distributed, command TIERS):

- a probe: the hashes of blocks rank 0 found in its own disk files while looking a prompt up;
  every rank reads and verifies its own file of each, and the ranks agree (an all-reduce of the
  minimum) on which every one of them holds: only those count as on disk, on every rank alike.
- the moves: the blocks to write to disk after a step (pool block, hash), and before the next
  forward the saves to the host tier, the loads from it and the loads from disk (a disk load
  names its hash: each rank loads the payload it verified at the probe).

Numbers only: a hash travels as four int64 words (a SHA-256 digest, common/block_hash.py),
nothing is pickled. Torch-free; it never decides which block goes where (the book does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.kv_tiers.book import TierTransfers

PROBE, MOVES = 1, 2
HASH_BYTES = 32
_WORDS = HASH_BYTES // 8


@dataclass
class TierMoves:
    """What a rank does with its own shard, in this order: persist, then the transfers."""

    # (pool block, block hash): written to this rank's disk files.
    persists: list[tuple[int, bytes]] = field(default_factory=list)
    transfers: TierTransfers = field(default_factory=TierTransfers)


def _words(block_hash: bytes) -> list[int]:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(
            f"a KV block hash sent to the ranks must be {HASH_BYTES} bytes, got {len(block_hash)}"
        )
    return np.frombuffer(block_hash, dtype="<i8").tolist()


def _hash(words: np.ndarray) -> bytes:
    return words.astype("<i8").tobytes()


def encode_probe(hashes: list[bytes]) -> np.ndarray:
    return np.array([PROBE, len(hashes), *(w for h in hashes for w in _words(h))], dtype=np.int64)


def encode_moves(moves: TierMoves) -> np.ndarray:
    t = moves.transfers
    values = [MOVES, len(moves.persists), len(t.saves), len(t.host_loads), len(t.disk_loads)]
    for block, block_hash in moves.persists:
        values += [block, *_words(block_hash)]
    for pair in (*t.saves, *t.host_loads):
        values += pair
    for block_hash, block in t.disk_loads:
        values += [block, *_words(block_hash)]
    return np.array(values, dtype=np.int64)


def decode(payload: np.ndarray) -> list[bytes] | TierMoves:
    """A probe's hashes, or the moves (their disk loads without payloads: each rank has its own)."""
    kind = int(payload[0])
    if kind == PROBE:
        count = int(payload[1])
        return [_hash(payload[2 + i * _WORDS : 2 + (i + 1) * _WORDS]) for i in range(count)]
    if kind != MOVES:
        raise ValueError(f"unknown KV tier message kind {kind} from rank 0")
    persists_n, saves_n, host_n, disk_n = (int(v) for v in payload[1:5])
    length = 5 + (persists_n + disk_n) * (1 + _WORDS) + 2 * (saves_n + host_n)
    if length != len(payload):
        raise ValueError(f"a KV tier message of {len(payload)} words; its counts say {length}")
    at = 5

    def hashed(n: int) -> list[tuple[int, bytes]]:
        nonlocal at
        rows = payload[at : at + n * (1 + _WORDS)].reshape(n, 1 + _WORDS)
        at += n * (1 + _WORDS)
        return [(int(row[0]), _hash(row[1:])) for row in rows]

    def pairs(n: int) -> list[tuple[int, int]]:
        nonlocal at
        rows = payload[at : at + 2 * n].reshape(n, 2)
        at += 2 * n
        return [(int(a), int(b)) for a, b in rows]

    persists = hashed(persists_n)
    saves = pairs(saves_n)
    host_loads = pairs(host_n)
    disk_loads = [(block_hash, block) for block, block_hash in hashed(disk_n)]
    return TierMoves(persists, TierTransfers(saves, host_loads, disk_loads))
