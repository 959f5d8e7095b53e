"""Bookkeeping for the paged KV cache: which physical blocks each request owns.

The pool holds `num_blocks` blocks of `block_size` token slots. Every block is in exactly one
state: free (never used, or content no longer worth keeping), evictable (refcount 0 but its
full content is registered in the prefix cache under a chained hash, reusable until evicted in
LRU order), or referenced by live requests' block tables (refcount > 0).

Blocks are shared by reference: through the prefix cache (full blocks) and by `fork`, which
hands an n > 1 request's computed prompt, its partial last block included, to each of its
samples. A request about to write into a block that others still hold gets a fresh block
instead (copy-on-write); the copy of the shared block's content is recorded for the executor,
which performs it before the step's forward (`take_block_copies`).

As it registers and evicts cached blocks it records KV events (engine.core.kv_events) for the engine
to publish after the step: routers index them to find which engine holds a prompt's prefix.

This module only moves block ids around: it never touches KV tensors (the executor owns them)
and never decides which request runs or gets preempted (the scheduler does).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from common.block_hash import ROOT_HASH, hash_block
from engine.core.kv_events import BlockRemoved, BlockStored, KVEvent
from engine.core.request import Request


def num_blocks_for_budget(
    memory_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype_bytes: int,
) -> int:
    """How many blocks (K and V, all layers) fit in `memory_bytes`."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
        ("dtype_bytes", dtype_bytes),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    bytes_per_block = 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes
    num_blocks = memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {memory_bytes} bytes cannot hold one block "
            f"({bytes_per_block} bytes); raise the budget or lower block_size"
        )
    return num_blocks


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Refcount-0 blocks still registered in the cache; the first entry is evicted first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # chained hash -> the block registered under it
        self._block_hash: list[bytes | None] = [None] * num_blocks
        # Copy-on-write copies not yet handed to the executor: destination block -> source.
        self._copies: dict[int, int] = {}
        # Cumulative, in tokens, counted on each admission (a request's first allocate).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Stored and removed blocks since the last take_kv_events, in order.
        self._kv_events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block: int) -> int:
        """How many block tables hold `block`."""
        return self._ref_counts[block]

    def get_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks holding the longest prefix of request.token_ids, and its length.

        At least one token is left out so that the step computes the last token's logits.
        Statistics are counted when the request is admitted (its first allocate), so a request
        that waits and is looked up again every step counts once. A request still owed prompt
        logprobs gets nothing: cached tokens are never computed, so they have no logits; nor
        does an embedding request: mean and CLS pooling read every token's hidden state.
        """
        if (
            not self.enable_prefix_caching
            or request.needs_prompt_logprobs
            or request.pooling is not None
        ):
            return [], 0
        tokens = request.token_ids
        size = self.block_size
        blocks: list[int] = []
        parent = ROOT_HASH
        for i in range((len(tokens) - 1) // size):
            parent = hash_block(parent, tokens[i * size : (i + 1) * size])
            block = self._cached.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * size

    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow request.block_table to cover `num_new_tokens` more tokens; all or nothing.

        `cached_blocks` (from get_cached_prefix just before) may only be given while the
        request holds no blocks; they then count as its computed tokens.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if cached_blocks and request.block_table:
            raise ValueError(
                f"request {request.request_id} already holds blocks; cannot take cached ones"
            )
        num_computed = (
            len(cached_blocks) * self.block_size if cached_blocks else request.num_computed_tokens
        )
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_fresh = max(0, num_needed - len(request.block_table) - len(cached_blocks))
        # The block the new tokens start in, if it is partly written and shared (a forked
        # prompt's last block): it must be copied before this request writes into it.
        first_new = num_computed // self.block_size
        shared: int | None = None
        if (
            num_new_tokens != 0
            and first_new < len(request.block_table)
            and self._ref_counts[request.block_table[first_new]] != 1
        ):
            shared = first_new
        # Taking an evictable cached block removes it from what fresh blocks can come from.
        num_revived = sum(1 for block in cached_blocks if self._ref_counts[block] == 0)
        if num_fresh + (shared is not None) > self.num_free_blocks - num_revived:
            return False

        if self.enable_prefix_caching and not request.block_table:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(cached_blocks) * self.block_size
        for block in cached_blocks:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            request.block_table.append(block)
            request.block_hashes.append(self._hash_of(block))
        for _ in range(num_fresh):
            request.block_table.append(self._take_fresh())
        if shared is not None:
            source = request.block_table[shared]
            self._ref_counts[source] -= 1  # others still hold it: never 0 here
            copy = request.block_table[shared] = self._take_fresh()
            # A destination freed and taken again this step keeps only its latest copy.
            self._copies[copy] = source
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` (holding no blocks) the parent's blocks by reference, with the prefix
        cache hashes of the full ones: it continues from the parent's computed tokens."""
        if child.block_table:
            raise ValueError(
                f"request {child.request_id} already holds blocks; cannot fork into it"
            )
        for block in parent.block_table:
            self._ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies that copy-on-write recorded since the last
        call, for the executor to perform before the next forward; clears them.

        Destinations are distinct. A source freed and taken again in the same step can also be
        a destination, so the executor reads every source before it writes any destination.
        """
        copies = [(source, dest) for dest, source in self._copies.items()]
        self._copies.clear()
        return copies

    def _take_fresh(self) -> int:
        block = self._free.popleft() if self._free else self._evict()
        self._ref_counts[block] = 1
        return block

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full once `num_computed_tokens` are
        computed. An embedding request's are not: its blocks are freed as soon as it is pooled,
        and a stream of documents would only push out the prefixes generation reuses."""
        if not self.enable_prefix_caching or request.pooling is not None:
            return
        size = self.block_size
        tokens = request.token_ids
        hashes = request.block_hashes
        num_full = min(num_computed_tokens // size, len(request.block_table))
        stored: BlockStored | None = None  # this call's current run of newly cached blocks
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else ROOT_HASH
            block_tokens = tokens[i * size : (i + 1) * size]
            block_hash = hash_block(parent, block_tokens)
            hashes.append(block_hash)
            # Another block may already hold this content; keep that one as the cached copy.
            if block_hash not in self._cached:
                block = request.block_table[i]
                self._cached[block_hash] = block
                self._block_hash[block] = block_hash
                if stored is None or stored.block_hashes[-1] != parent:
                    stored = BlockStored([], parent, [], size)
                    self._kv_events.append(stored)
                stored.block_hashes.append(block_hash)
                stored.token_ids += block_tokens

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first so that eviction drops tails first."""
        for block in reversed(request.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        request.block_table.clear()
        request.block_hashes.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every unreferenced cached block; False if there was none."""
        if not self._evictable:
            return False
        for block in self._evictable:
            self._uncache(block)
            self._free.append(block)
        self._evictable.clear()
        return True

    def take_kv_events(self) -> list[KVEvent]:
        """The blocks stored in and removed from the prefix cache since the last call, in
        order; clears them."""
        events, self._kv_events = self._kv_events, []
        return events

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        self._uncache(block)
        return block

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of(block)
        del self._cached[block_hash]
        self._block_hash[block] = None
        # Evictions in a row (one allocation, a reset) are one event.
        last = self._kv_events[-1] if self._kv_events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._kv_events.append(BlockRemoved([block_hash]))

    def _hash_of(self, block: int) -> bytes:
        """The hash of a block registered in the cache (every cached or evictable block is)."""
        block_hash = self._block_hash[block]
        if block_hash is None:
            raise RuntimeError(f"block {block} is not registered in the prefix cache")
        return block_hash
