"""The tiers' books: which blocks, by chained block hash and KV group, the host tier and the disk
tier hold, and the transfers a step owes.

The KV cache manager (engine.core.kv_cache_manager) calls in at four points: a cached block
evicted from the pool (`evicted`: it gets a host slot, the least recently evicted entry making
room, pinned entries last: an unpinned block finding only pinned ones is not kept), a prompt
looked up (`holds`), a looked-up block taken (`claim`, then `load` into a fresh pool block: it
leaves the host tier, so every block lives in one memory tier and the order of eviction is one
LRU from the pool down), and a block newly registered (`registered`: written
through to disk when there is a disk tier, so a process killed a step later loses nothing). The
executor's tier store (engine.kv_tiers.store) takes the step's saves and loads before the
forward (`take_transfers`: saves first, since a block evicted this step may be the one a load
writes into); after the step the engine's `flush` hands it the blocks to persist.

With tensor parallelism the book is rank 0's alone; a block it finds in rank 0's disk files
counts only if every rank holds it (`lacking_on_some_rank`, called by the KV cache manager at
the end of a lookup: one question to the ranks for all the blocks it found there).

A model with several KV groups (sliding-window layers: engine.core.kv_cache_manager) has a
block of each group under each chained hash, and the pool caches, evicts and frees them apart (a
sliding group's leave once behind its window). So a tier keeps each group's block as an entry
of its own, named by `tier_key` (the hash, and the group past the first): the same one block id
of bytes as in a one-group model, present for the groups whose block the pool registered and
absent for the others. The KV cache manager asks for each group's block where a hit needs it.

Torch-free, like the core that calls it: slots and hashes only, never a tensor.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.kv_events import MEDIUM_HOST, BlockRemoved, BlockStored, KVEvent
from engine.kv_tiers.disk_tier import DiskTier
from engine.kv_tiers.pins import PinBook

# The placeholder get_cached_prefix puts where a lower tier holds the block (never a block id).
TIER_BLOCK = -2
# Disk payloads verified while looking a prompt up, kept until the step's transfers: at most.
MAX_STAGED_BYTES = 512 * 1024**2
# A chained block hash's length (a SHA-256 digest: common/block_hash.py).
HASH_BYTES = 32


def tier_key(block_hash: bytes, group: int) -> bytes:
    """The name of KV group `group`'s block under `block_hash` in every tier (a host entry, a disk
    file, a message to the ranks): the first group's is the hash itself, so that a one-group
    model's files keep their names; another group's is the hash and the group's number."""
    if not 0 <= group < 256:
        raise ValueError(f"a KV tier serves at most 256 KV groups, got group {group}")
    return block_hash if group == 0 else block_hash + bytes([group])


def key_hash(key: bytes) -> bytes:
    """The chained block hash a tier key names (what pins are kept by)."""
    return key[:HASH_BYTES]


def key_group(key: bytes) -> int:
    return key[HASH_BYTES] if len(key) > HASH_BYTES else 0


@dataclass
class TierTransfers:
    """What the store does before a step's forward, in this order."""

    # (pool block, host slot): copy out before anything writes the block.
    saves: list[tuple[int, int]] = field(default_factory=list)
    # (host slot, pool block) and (tier key, pool block).
    host_loads: list[tuple[int, int]] = field(default_factory=list)
    disk_loads: list[tuple[bytes, int]] = field(default_factory=list)
    # The disk loads' verified payloads, by tier key (each rank has its own: never sent).
    payloads: dict[bytes, bytes] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.saves or self.host_loads or self.disk_loads)


@dataclass(frozen=True)
class Source:
    """A claimed block: from a host slot, or a disk payload (and its tier key)."""

    slot: int | None = None
    payload: bytes | None = None
    key: bytes = b""


class TierBook:
    def __init__(self, host_blocks: int, disk: DiskTier | None = None, block_size: int = 0) -> None:
        """`block_size`: tokens per block, as the host tier's KV events say."""
        self.host_blocks = host_blocks
        self.block_size = block_size
        self.disk = disk
        self._host: OrderedDict[bytes, int] = OrderedDict()  # tier key -> slot, oldest first
        self._free_slots = list(range(host_blocks - 1, -1, -1))
        # Slots loaded from this step: free once the step's loads have read them.
        self._released: list[int] = []
        self._saves: dict[int, int] = {}  # slot -> pool block (the latest save of a slot wins)
        self._transfers = TierTransfers()
        self._staged: dict[bytes, bytes] = {}
        self._staged_bytes = 0
        self._persists: list[tuple[int, bytes]] = []
        # Where `flush` hands the blocks to persist, (pool block, tier key), and the pinned
        # hashes when they changed (the executor's tier store).
        self.sink: Callable[[list[tuple[int, bytes]], list[bytes] | None], None] | None = None
        # The first KV group's blocks served, per tier ("host", "disk"), and blocks evicted to
        # the host tier.
        self.hits: Counter[str] = Counter()
        self.offloaded = 0
        # The host tier's KV events (medium MEDIUM_HOST) since the last take_events.
        self._events: list[KVEvent] = []
        # The KV cache manager's pins (`track_pins`): the host tier drops a pinned block only
        # when it holds nothing else.
        self.pins: PinBook | None = None
        # With tensor parallelism: whether every rank holds a valid file of each of these
        # blocks (tier keys), found in rank 0's disk files (engine.kv_tiers.store asks them all
        # at once); the blocks a lookup found there wait in _unsure for lacking_on_some_rank.
        self.ranks_hold: Callable[[list[bytes]], list[bool]] | None = None
        self._unsure: list[bytes] = []
        # The pins' `changes` when the pinned hashes were last handed to the sink.
        self._pins_sent = 0

    def track_pins(self, pins: PinBook) -> None:
        """The KV cache manager's pins: the host tier drops pinned blocks last, the disk tier
        deletes their files last (every rank's: the sink is handed the pinned hashes)."""
        self.pins = pins
        if self.disk is not None:
            self.disk.pinned = self.pinned

    def pinned(self, key: bytes) -> bool:
        """Whether the hash of a tier key is pinned."""
        return self.pins is not None and self.pins.is_pinned(key_hash(key))

    @property
    def host_used(self) -> int:
        return len(self._host)

    def holds(self, block_hash: bytes, group: int = 0) -> bool:
        """Whether a tier holds KV group `group`'s block under `block_hash` (a disk file is read
        and verified now, and kept for the step's loads)."""
        key = tier_key(block_hash, group)
        if key in self._host or key in self._staged:
            return True
        if self.disk is None or self._staged_bytes >= MAX_STAGED_BYTES:
            return False
        payload = self.disk.read(key)
        if payload is None:
            return False
        self._staged[key] = payload
        self._staged_bytes += len(payload)
        if self.ranks_hold is not None:
            self._unsure.append(key)
        return True

    def lacking_on_some_rank(self) -> list[tuple[bytes, int]]:
        """After a lookup's `holds`: the (block hash, group) it found that do not count. With
        tensor parallelism a block found in rank 0's disk files counts only if every rank holds
        a valid file of it (all of those found since the last call asked at once); one that
        some rank lacks is forgotten, so that once computed it is written again by every rank.
        One rank, or nothing found on disk since: none (and no question to the ranks)."""
        unsure, self._unsure = self._unsure, []
        if not unsure:
            return []
        assert self.ranks_hold is not None and self.disk is not None
        lacking = []
        for key, everywhere in zip(unsure, self.ranks_hold(unsure), strict=True):
            if not everywhere:
                self._staged_bytes -= len(self._staged.pop(key))
                self.disk.forget(key)
                lacking.append((key_hash(key), key_group(key)))
        return lacking

    def claim(self, block_hash: bytes, group: int = 0) -> Source:
        """Take a block `holds` just said is here, before fresh pool blocks are taken for it.
        Tokens served count the first group's blocks (as KV events announce them)."""
        key = tier_key(block_hash, group)
        slot = self._host.pop(key, None)
        if slot is not None:
            self._released.append(slot)
            if group == 0:
                self._events.append(BlockRemoved([block_hash], MEDIUM_HOST))
                self.hits["host"] += 1
            return Source(slot=slot)
        if group == 0:
            self.hits["disk"] += 1
        return Source(payload=self._staged.pop(key), key=key)

    def load(self, source: Source, block: int) -> None:
        if source.slot is not None:
            self._transfers.host_loads.append((source.slot, block))
        else:
            assert source.payload is not None
            self._transfers.disk_loads.append((source.key, block))
            self._transfers.payloads[source.key] = source.payload

    def evicted(self, block: int, block_hash: bytes, group: int = 0) -> None:
        """A cached block (KV group `group`'s) left the pool (its content intact until the
        step's forward). The host tier's KV events name the first group's blocks only."""
        if self.host_blocks == 0:
            return
        key = tier_key(block_hash, group)
        if key in self._host:
            self._host.move_to_end(key)
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            dropped = self._victim(self.pinned(key))
            if dropped is None:
                return  # every slot is being loaded from this step, or pinned
            slot = self._host.pop(dropped)
            if key_group(dropped) == 0:
                self._events.append(BlockRemoved([dropped], MEDIUM_HOST))
        self._host[key] = slot
        if group == 0:
            self._events.append(BlockStored([block_hash], b"", [], self.block_size, MEDIUM_HOST))
        self._saves[slot] = block
        self.offloaded += 1

    def _victim(self, for_pinned: bool) -> bytes | None:
        """The entry that makes room: the least recently evicted unpinned one; for a pinned
        block, failing that, the least recently evicted pinned one. Pinned entries passed over
        go to the back, as if evicted now (as a parked block in the pool is the most recently
        used when its pin ends), so the next call does not pass them again."""
        for _ in range(len(self._host)):
            oldest = next(iter(self._host))
            if not self.pinned(oldest):
                return oldest
            self._host.move_to_end(oldest)
        return next(iter(self._host), None) if for_pinned else None

    def registered(self, block: int, block_hash: bytes, group: int = 0) -> None:
        """A block (KV group `group`'s) newly registered in the prefix cache: written through
        to disk."""
        key = tier_key(block_hash, group)
        if self.disk is not None and not self.disk.knows(key):
            self._persists.append((block, key))

    def take_transfers(self) -> TierTransfers:
        transfers, self._transfers = self._transfers, TierTransfers()
        transfers.saves = [(block, slot) for slot, block in self._saves.items()]
        self._saves.clear()
        self._free_slots += self._released
        self._released.clear()
        self._staged.clear()
        self._staged_bytes = 0
        return transfers

    def report(self) -> tuple[dict[str, int], dict[str, float]]:
        """Per tier ("host", "disk", those in use): prompt tokens served since the start, and
        the share of its capacity in use (0 to 1)."""
        hits, usage = {}, {}
        if self.host_blocks:
            hits["host"] = self.hits["host"] * self.block_size
            usage["host"] = len(self._host) / self.host_blocks
        if self.disk is not None:
            hits["disk"] = self.hits["disk"] * self.block_size
            usage["disk"] = min(1.0, self.disk.used_bytes / self.disk.max_bytes)
        return hits, usage

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def flush(self) -> None:
        """After a step: the blocks it cached go to the sink, to be written to disk, and with
        a disk tier the pinned hashes when they changed since the sink last had them (other
        ranks' disk tiers delete pinned blocks' files last too)."""
        persists, self._persists = self._persists, []
        if self.sink is None or self.disk is None:
            return
        pinned = None
        if self.pins is not None and self.pins.changes != self._pins_sent:
            self._pins_sent = self.pins.changes
            pinned = self.pins.pinned_hashes()
        if persists or pinned is not None:
            self.sink(persists, pinned)
