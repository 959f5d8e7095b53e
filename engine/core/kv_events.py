"""KV-cache events: what the engine's prefix cache stores and evicts, for routers to index.

The KV cache manager records BlockStored (a run of chained blocks under one parent), BlockRemoved
and AllBlocksCleared as it registers and evicts blocks; after each step the engine hands them to
the KVEventPublisher, which numbers them as one batch (sequence numbers from 1, one epoch per
engine start), keeps the latest batches in a bounded replay buffer and passes each batch to its
subscribers. A subscriber that comes back knowing batches up to N (of the same epoch) gets N+1
onwards from the buffer; one whose gap is older than the buffer, or from another epoch, gets a
snapshot instead: AllBlocksCleared, then BlockStored for every block the cache holds. The shapes
follow vLLM's KV events, so routers built on those carry over, `medium` included: MEDIUM_POOL
("GPU", vLLM's name for the engine's KV pool, whatever its device) or MEDIUM_HOST ("CPU": the
host tier under the pool, engine.kv_tiers; its BlockStored carry the hashes only, no token ids).
A block moved from the pool to the host tier is a BlockRemoved in one medium and a BlockStored in
the other.

This module never touches KV tensors and never decides anything about blocks: it only records,
numbers and hands on. Thread-safe: the engine thread publishes, service threads subscribe.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

MEDIUM_POOL = "GPU"
MEDIUM_HOST = "CPU"


@dataclass
class BlockStored:
    """Full blocks newly registered in the prefix cache, a chain: block_hashes[0]'s parent is
    parent_block_hash (ROOT_HASH for a sequence's first block), each next one's parent the one
    before it. token_ids holds block_size ids per block, in order."""

    block_hashes: list[bytes]
    parent_block_hash: bytes
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_POOL
    # The LoRA adapter the blocks were computed with ("": the base model), as vLLM's lora_name.
    lora_name: str = ""


@dataclass
class BlockRemoved:
    """Blocks evicted from the prefix cache: their hashes no longer name cached content."""

    block_hashes: list[bytes]
    medium: str = MEDIUM_POOL


@dataclass
class AllBlocksCleared:
    """Forget every block of this engine known so far."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step (or a snapshot), numbered in the engine's epoch."""

    sequence_number: int
    epoch: str
    timestamp: float  # time.time() when published
    events: tuple[KVEvent, ...]
    # A snapshot stands for every batch up to sequence_number: it starts with AllBlocksCleared.
    snapshot: bool = False


@dataclass
class _CachedBlock:
    parent_hash: bytes
    token_ids: list[int]
    block_size: int
    lora_name: str


@dataclass(eq=False)
class Subscription:
    """A subscriber's registration: `close` stops the deliveries."""

    deliver: Callable[[KVEventBatch], None]
    _publisher: KVEventPublisher | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher._unsubscribe(self)
            self._publisher = None


class KVEventPublisher:
    def __init__(self, replay_capacity: int) -> None:
        if replay_capacity < 1:
            raise ValueError(f"replay_capacity must be >= 1, got {replay_capacity}")
        self.epoch = uuid.uuid4().hex  # new at each engine start
        self._lock = threading.Lock()
        self._replay: collections.deque[KVEventBatch] = collections.deque(maxlen=replay_capacity)
        self._last_sequence_number = 0
        self._subscribers: list[Subscription] = []
        # What the cache holds now, from the events themselves, for snapshots; insertion
        # order puts every parent before its children.
        self._blocks: dict[tuple[str, bytes], _CachedBlock] = {}  # by (medium, hash)

    @property
    def last_sequence_number(self) -> int:
        return self._last_sequence_number

    def publish(self, events: list[KVEvent]) -> None:
        """Number `events` as the next batch and hand it to every subscriber (nothing if empty)."""
        if not events:
            return
        with self._lock:
            for event in events:
                self._apply(event)
            self._last_sequence_number += 1
            batch = KVEventBatch(self._last_sequence_number, self.epoch, time.time(), tuple(events))
            self._replay.append(batch)
            for subscription in self._subscribers:
                subscription.deliver(batch)

    def subscribe(
        self,
        start_sequence_number: int,
        epoch: str,
        deliver: Callable[[KVEventBatch], None],
    ) -> tuple[list[KVEventBatch], Subscription]:
        """Register `deliver` for every batch published from now on; returns what comes before
        them: the batches from `start_sequence_number` on (0 and 1 both mean from the first),
        or one snapshot when those are no longer all in the buffer or `epoch` (the epoch the
        subscriber knew, "" for none) is another engine's."""
        with self._lock:
            # Numbers of another epoch mean nothing here: such a subscriber gets a snapshot at
            # once, whose AllBlocksCleared makes it forget the engine that was there before.
            start = max(start_sequence_number, 1)
            oldest = self._replay[0].sequence_number if self._replay else 1
            if epoch in ("", self.epoch) and oldest <= start <= self._last_sequence_number + 1:
                backlog = [b for b in self._replay if b.sequence_number >= start]
            else:
                backlog = [self._snapshot()]
            subscription = Subscription(deliver, self)
            self._subscribers.append(subscription)
            return backlog, subscription

    def _unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscribers.remove(subscription)

    def _apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            parent, size = event.parent_block_hash, event.block_size
            for i, block_hash in enumerate(event.block_hashes):
                self._blocks[event.medium, block_hash] = _CachedBlock(
                    parent, event.token_ids[i * size : (i + 1) * size], size, event.lora_name
                )
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._blocks.pop((event.medium, block_hash), None)
        else:
            self._blocks.clear()

    def _snapshot(self) -> KVEventBatch:
        events: list[KVEvent] = [AllBlocksCleared(), *self._chains()]
        return KVEventBatch(
            self._last_sequence_number, self.epoch, time.time(), tuple(events), snapshot=True
        )

    def _chains(self) -> Iterator[BlockStored]:
        """The cached blocks as BlockStored runs: a block joins the run before it when that
        run (of its medium and adapter) ends with its parent."""
        run: BlockStored | None = None
        for (medium, block_hash), block in self._blocks.items():
            if (
                run is None
                or run.block_hashes[-1] != block.parent_hash
                or (run.medium, run.lora_name) != (medium, block.lora_name)
            ):
                if run is not None:
                    yield run
                run = BlockStored(
                    [], block.parent_hash, [], block.block_size, medium, block.lora_name
                )
            run.block_hashes.append(block_hash)
            run.token_ids.extend(block.token_ids)
        if run is not None:
            yield run
