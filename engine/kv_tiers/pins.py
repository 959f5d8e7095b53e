"""Pinned prefixes: which chained block hashes requests asked to keep, whose pins they are,
until when, and the bounds on how many may be pinned at once.

The KV cache manager (engine.core.kv_cache_manager) pins a pinning request's prompt blocks as
they are cached (`pin`), asks whether a block that drops to refcount 0 is pinned (`is_pinned`:
then it is parked in the pool, not evictable; the host tier keeps it before unpinned blocks),
and before each allocation takes the pins whose TTL ended (`expire`) to make their blocks
evictable again. Two bounds: the engine's (`max_blocks`, a share of the pool: the hashes pinned
by anyone, each once) and each owner's (an API key's, as the gateway names it: the hashes that
owner pinned, each once, however often pinned again). Pinning a hash its owner pinned already
extends that owner's TTL, never shortens it, and costs no room; a hash stays pinned while any
owner's pin on it lasts. The clock is an attribute so tests can drive time.

Torch-free and block-id-free: hashes, owners and deadlines only; it never evicts or frees a
block.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable

# The share of the pool's blocks pins may hold at once: the rest stays for running requests.
MAX_PINNED_SHARE = 0.5
# The longest pin a request may ask for (Anthropic's longest cache_control TTL is an hour).
MAX_PIN_TTL_SECONDS = 3600.0
# What `pin` answers when a bound refuses a hash: the engine's, or the owner's.
POOL_BOUND = "pool"
OWNER_BOUND = "owner"


class PinBook:
    def __init__(self, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self.clock = clock
        self._pins: dict[bytes, dict[str, float]] = {}  # hash -> owner -> when its pin ends
        self._owned: Counter[str] = Counter()  # owner -> hashes it pins
        self._deadlines: list[tuple[float, bytes, str]] = []  # heap; stale entries skipped
        # Counts the changes to which hashes are pinned (what other ranks are sent anew).
        self.changes = 0

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def pinned_hashes(self) -> list[bytes]:
        return list(self._pins)

    def owned(self, owner: str) -> int:
        """How many hashes `owner` pins."""
        return self._owned[owner]

    def pin(
        self, block_hash: bytes, ttl_seconds: float, owner: str = "", owner_max: int | None = None
    ) -> str | None:
        """Pin (or extend `owner`'s pin of) a block for ttl_seconds from now. None when pinned;
        OWNER_BOUND when `owner` already pins `owner_max` hashes, POOL_BOUND when the engine's
        bound is reached, and this hash is not pinned (by this owner; by anyone) already."""
        owners = self._pins.get(block_hash, {})
        if owner not in owners:
            if owner_max is not None and self._owned[owner] >= owner_max:
                return OWNER_BOUND
            if not owners and len(self._pins) >= self.max_blocks:
                return POOL_BOUND
            self._owned[owner] += 1
            if not owners:
                self.changes += 1
        until = max(owners.get(owner, 0.0), self.clock() + ttl_seconds)
        owners[owner] = until
        self._pins[block_hash] = owners
        heapq.heappush(self._deadlines, (until, block_hash, owner))
        return None

    def unpin(self, block_hash: bytes) -> None:
        """Every owner's pin of the hash ends now (their heap entries are skipped as stale)."""
        for owner in self._pins.pop(block_hash):
            self._disown(owner)
        self.changes += 1

    def is_pinned(self, block_hash: bytes) -> bool:
        return block_hash in self._pins

    def expire(self) -> list[bytes]:
        """The hashes whose last pin ended by now; they are no longer pinned. An owner whose
        pin ended has that hash off its count."""
        if not self._deadlines:
            return []
        now, ended = self.clock(), []
        while self._deadlines and self._deadlines[0][0] <= now:
            until, block_hash, owner = heapq.heappop(self._deadlines)
            owners = self._pins.get(block_hash)
            if owners is None or owners.get(owner) != until:  # unpinned, or extended since
                continue
            del owners[owner]
            self._disown(owner)
            if not owners:
                del self._pins[block_hash]
                ended.append(block_hash)
                self.changes += 1
        return ended

    def _disown(self, owner: str) -> None:
        self._owned[owner] -= 1
        if not self._owned[owner]:
            del self._owned[owner]  # owners come and go: keep only those pinning
