"""The tiers' books: which chained block hashes the host tier and the disk tier hold, and the
transfers a step owes.

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
counts only if every rank holds it (`held_on_every_rank`, called by the KV cache manager at the
end of a lookup: one question to the ranks for all the blocks it found there).

Torch-free, like the core that calls it: slots and hashes only, never a tensor.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.kv_events import MEDIUM_HOST, BlockRemoved, BlockStored, KVEvent
from engine.kv_tiers.disk_tier import DiskTier

# The placeholder get_cached_prefix puts where a lower tier holds the block (never a block id).
TIER_BLOCK = -2
# Disk payloads verified while looking a prompt up, kept until the step's transfers: at most.
MAX_STAGED_BYTES = 512 * 1024**2


@dataclass
class TierTransfers:
    """What the store does before a step's forward, in this order."""

    # (pool block, host slot): copy out before anything writes the block.
    saves: list[tuple[int, int]] = field(default_factory=list)
    # (host slot, pool block) and (block hash, pool block).
    host_loads: list[tuple[int, int]] = field(default_factory=list)
    disk_loads: list[tuple[bytes, int]] = field(default_factory=list)
    # The disk loads' verified payloads, by hash (each rank has its own: never sent).
    payloads: dict[bytes, bytes] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.saves or self.host_loads or self.disk_loads)


@dataclass(frozen=True)
class Source:
    """A claimed block: from a host slot, or a disk payload (and its hash)."""

    slot: int | None = None
    payload: bytes | None = None
    block_hash: bytes = b""


class TierBook:
    def __init__(self, host_blocks: int, disk: DiskTier | None = None, block_size: int = 0) -> None:
        """`block_size`: tokens per block, as the host tier's KV events say."""
        self.host_blocks = host_blocks
        self.block_size = block_size
        self.disk = disk
        self._host: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self._free_slots = list(range(host_blocks - 1, -1, -1))
        # Slots loaded from this step: free once the step's loads have read them.
        self._released: list[int] = []
        self._saves: dict[int, int] = {}  # slot -> pool block (the latest save of a slot wins)
        self._transfers = TierTransfers()
        self._staged: dict[bytes, bytes] = {}
        self._staged_bytes = 0
        self._persists: list[tuple[int, bytes]] = []
        # Where `flush` hands the blocks to persist (the executor's tier store).
        self.sink: Callable[[list[tuple[int, bytes]]], None] | None = None
        # Blocks served, per tier ("host", "disk"), and evicted to the host tier.
        self.hits: Counter[str] = Counter()
        self.offloaded = 0
        # The host tier's KV events (medium MEDIUM_HOST) since the last take_events.
        self._events: list[KVEvent] = []
        # Whether a hash is pinned (`track_pins`): the host tier drops a pinned block only when
        # it holds nothing else.
        self.pinned: Callable[[bytes], bool] = lambda block_hash: False
        # With tensor parallelism: whether every rank holds a valid file of each of these
        # blocks, found in rank 0's disk files (engine.kv_tiers.store asks them all at once);
        # the blocks a lookup found there wait in _unsure for held_on_every_rank.
        self.ranks_hold: Callable[[list[bytes]], list[bool]] | None = None
        self._unsure: list[bytes] = []

    def track_pins(self, pinned: Callable[[bytes], bool]) -> None:
        """Which hashes are pinned (the KV cache manager's pins): the host tier drops them
        last, the disk tier deletes their files last."""
        self.pinned = pinned
        if self.disk is not None:
            self.disk.pinned = pinned

    @property
    def host_used(self) -> int:
        return len(self._host)

    def holds(self, block_hash: bytes) -> bool:
        if block_hash in self._host or block_hash in self._staged:
            return True
        if self.disk is None or self._staged_bytes >= MAX_STAGED_BYTES:
            return False
        payload = self.disk.read(block_hash)
        if payload is None:
            return False
        self._staged[block_hash] = payload
        self._staged_bytes += len(payload)
        if self.ranks_hold is not None:
            self._unsure.append(block_hash)
        return True

    def held_on_every_rank(self, hashes: list[bytes]) -> int:
        """After a lookup found `hashes` (a prompt's leading blocks, in order) in the tiers:
        how many of them count. With tensor parallelism a block found in rank 0's disk files
        by this lookup counts only if every rank holds a valid file of it (all of them asked
        at once); the prefix ends at the first that some rank lacks, and that block is
        forgotten, so that once computed it is written again by every rank. One rank: all."""
        unsure, self._unsure = self._unsure, []
        if not unsure:
            return len(hashes)
        assert self.ranks_hold is not None and self.disk is not None
        lacking = set()
        for block_hash, everywhere in zip(unsure, self.ranks_hold(unsure), strict=True):
            if not everywhere:
                self._staged_bytes -= len(self._staged.pop(block_hash))
                self.disk.forget(block_hash)
                lacking.add(block_hash)
        return next((i for i, h in enumerate(hashes) if h in lacking), len(hashes))

    def claim(self, block_hash: bytes) -> Source:
        """Take a block `holds` just said is here, before fresh pool blocks are taken for it."""
        slot = self._host.pop(block_hash, None)
        if slot is not None:
            self._released.append(slot)
            self._events.append(BlockRemoved([block_hash], MEDIUM_HOST))
            self.hits["host"] += 1
            return Source(slot=slot)
        self.hits["disk"] += 1
        return Source(payload=self._staged.pop(block_hash), block_hash=block_hash)

    def load(self, source: Source, block: int) -> None:
        if source.slot is not None:
            self._transfers.host_loads.append((source.slot, block))
        else:
            assert source.payload is not None
            self._transfers.disk_loads.append((source.block_hash, block))
            self._transfers.payloads[source.block_hash] = source.payload

    def evicted(self, block: int, block_hash: bytes) -> None:
        """A cached block left the pool (its content intact until the step's forward)."""
        if self.host_blocks == 0:
            return
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            dropped = self._victim(self.pinned(block_hash))
            if dropped is None:
                return  # every slot is being loaded from this step, or pinned
            slot = self._host.pop(dropped)
            self._events.append(BlockRemoved([dropped], MEDIUM_HOST))
        self._host[block_hash] = slot
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

    def registered(self, block: int, block_hash: bytes) -> None:
        """A block newly registered in the prefix cache: written through to disk."""
        if self.disk is not None and not self.disk.knows(block_hash):
            self._persists.append((block, block_hash))

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
        """After a step: the blocks it cached go to the sink, to be written to disk."""
        persists, self._persists = self._persists, []
        if persists and self.sink is not None:
            self.sink(persists)
