"""Pinned prefixes: which chained block hashes a request asked to keep, until when, and the bound
on how many may be pinned at once.

The KV cache manager (engine.core.kv_cache_manager) pins a pinning request's prompt blocks as
they are cached (`pin`), asks whether a block that drops to refcount 0 is pinned (`is_pinned`:
then it is parked in the pool, not evictable), and before each allocation takes the pins whose
TTL ended (`expire`) to make their blocks evictable again. Pinning a hash already pinned
extends its TTL and costs no room. The clock is an attribute so tests can drive time.

Torch-free and block-id-free: hashes and deadlines only; it never evicts or frees a block.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

# The share of the pool's blocks pins may hold at once: the rest stays for running requests.
MAX_PINNED_SHARE = 0.5
# The longest pin a request may ask for (Anthropic's longest cache_control TTL is an hour).
MAX_PIN_TTL_SECONDS = 3600.0


class PinBook:
    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self.clock = clock
        self._until: dict[bytes, float] = {}  # hash -> when its pin ends
        self._deadlines: list[tuple[float, bytes]] = []  # heap; stale entries skipped

    @property
    def num_pinned(self) -> int:
        return len(self._until)

    def pin(self, block_hash: bytes, ttl_seconds: float) -> bool:
        """Pin (or extend the pin of) a block for ttl_seconds from now; False when the bound is
        reached and the block is not pinned already."""
        if block_hash not in self._until and len(self._until) >= self.max_blocks:
            return False
        until = max(self._until.get(block_hash, 0.0), self.clock() + ttl_seconds)
        self._until[block_hash] = until
        heapq.heappush(self._deadlines, (until, block_hash))
        return True

    def unpin(self, block_hash: bytes) -> None:
        del self._until[block_hash]  # its heap entry is skipped as stale

    def is_pinned(self, block_hash: bytes) -> bool:
        return block_hash in self._until

    def expire(self) -> list[bytes]:
        """The hashes whose pins ended by now; they are no longer pinned."""
        if not self._deadlines:
            return []
        now, ended = self.clock(), []
        while self._deadlines and self._deadlines[0][0] <= now:
            until, block_hash = heapq.heappop(self._deadlines)
            if self._until.get(block_hash) == until:  # not extended since
                del self._until[block_hash]
                ended.append(block_hash)
        return ended
