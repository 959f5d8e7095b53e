"""The tier moves rank 0 sends the other tensor-parallel ranks, as plain int64 arrays.

Rank 0 keeps the tiers' book (engine.kv_tiers.book) beside the scheduler; every rank keeps its
own shard of the KV heads in its own host tier and its own disk files (engine.kv_tiers.store).
So that every rank moves the same blocks at the same point of the step sequence, rank 0 sends
what the book decides through the group's broadcast (engine.distributed, command TIERS):

- a probe: the blocks rank 0 found in its own disk files while looking a prompt up; every rank
  reads and verifies its own file of each, and the ranks agree (an all-reduce of the minimum)
  on which every one of them holds: only those count as on disk, on every rank alike.
- the moves: the blocks to write to disk after a step (pool block, tier key), with the pinned
  block hashes when they changed (each rank's disk bound deletes pinned blocks' files last), and
  before the next forward the saves to the host tier, the loads from it and the loads from disk
  (a disk load names its tier key: each rank loads the payload it verified at the probe).

Numbers only: a block travels as its tier key (engine.kv_tiers.book.tier_key): five int64 words,
the four of its hash (a SHA-256 digest, common/block_hash.py) and its KV group; nothing is
pickled. Torch-free; it never decides which block goes where (the book does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.kv_tiers.book import HASH_BYTES, TierTransfers, key_group, key_hash, tier_key

PROBE, MOVES = 1, 2
# A tier key's words: its hash's, and its group.
_WORDS = HASH_BYTES // 8 + 1
# The pins' count in a moves message that carries no pinned hashes (they did not change).
_UNCHANGED = -1


@dataclass
class TierMoves:
    """What a rank does with its own shard, in this order: persist, then the transfers."""

    # (pool block, tier key): written to this rank's disk files.
    persists: list[tuple[int, bytes]] = field(default_factory=list)
    transfers: TierTransfers = field(default_factory=TierTransfers)
    # Every block hash pinned now, when that changed since the last moves that carried them.
    pinned: list[bytes] | None = None


def _words(key: bytes) -> list[int]:
    block_hash = key_hash(key)
    if len(block_hash) != HASH_BYTES:
        raise ValueError(
            f"a KV block hash sent to the ranks must be {HASH_BYTES} bytes, got {len(block_hash)}"
        )
    return [*np.frombuffer(block_hash, dtype="<i8").tolist(), key_group(key)]


def _key(words: np.ndarray) -> bytes:
    return tier_key(words[:-1].astype("<i8").tobytes(), int(words[-1]))


def encode_probe(keys: list[bytes]) -> np.ndarray:
    return np.array([PROBE, len(keys), *(w for k in keys for w in _words(k))], dtype=np.int64)


def encode_moves(moves: TierMoves) -> np.ndarray:
    t = moves.transfers
    pinned = moves.pinned
    values = [
        MOVES,
        len(moves.persists),
        len(t.saves),
        len(t.host_loads),
        len(t.disk_loads),
        _UNCHANGED if pinned is None else len(pinned),
    ]
    for block, key in moves.persists:
        values += [block, *_words(key)]
    for pair in (*t.saves, *t.host_loads):
        values += pair
    for key, block in t.disk_loads:
        values += [block, *_words(key)]
    for block_hash in pinned or ():
        values += _words(block_hash)
    return np.array(values, dtype=np.int64)


def decode(payload: np.ndarray) -> list[bytes] | TierMoves:
    """A probe's tier keys, or the moves (their disk loads without payloads: each rank has its
    own)."""
    kind = int(payload[0])
    if kind == PROBE:
        count = int(payload[1])
        return [_key(payload[2 + i * _WORDS : 2 + (i + 1) * _WORDS]) for i in range(count)]
    if kind != MOVES:
        raise ValueError(f"unknown KV tier message kind {kind} from rank 0")
    persists_n, saves_n, host_n, disk_n, pinned_n = (int(v) for v in payload[1:6])
    if min(persists_n, saves_n, host_n, disk_n) < 0 or pinned_n < _UNCHANGED:
        raise ValueError(f"a KV tier message with a negative count: {payload[1:6].tolist()}")
    length = (
        6
        + (persists_n + disk_n) * (1 + _WORDS)
        + 2 * (saves_n + host_n)
        + max(pinned_n, 0) * _WORDS
    )
    if length != len(payload):
        raise ValueError(f"a KV tier message of {len(payload)} words; its counts say {length}")
    at = 6

    def hashed(n: int) -> list[tuple[int, bytes]]:
        nonlocal at
        rows = payload[at : at + n * (1 + _WORDS)].reshape(n, 1 + _WORDS)
        at += n * (1 + _WORDS)
        return [(int(row[0]), _key(row[1:])) for row in rows]

    def pairs(n: int) -> list[tuple[int, int]]:
        nonlocal at
        rows = payload[at : at + 2 * n].reshape(n, 2)
        at += 2 * n
        return [(int(a), int(b)) for a, b in rows]

    persists = hashed(persists_n)
    saves = pairs(saves_n)
    host_loads = pairs(host_n)
    disk_loads = [(key, block) for block, key in hashed(disk_n)]
    pinned = None
    if pinned_n != _UNCHANGED:
        rows = payload[at:].reshape(pinned_n, _WORDS)
        pinned = [_key(row) for row in rows]
    return TierMoves(persists, TierTransfers(saves, host_loads, disk_loads), pinned)
