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

Sliding-window layers (Mistral, Gemma 3's local layers) never look back past their window, so
their KV need not outlive it. The layers are split into KV groups (`kv_groups`): all of one kind
of attention (full, or one window size), at most as many layers per group as the smallest kind
has, so that one block id holds the same number of layers in every group and all groups draw
on one pool (vLLM's hybrid allocator does the same). A request's block table holds, for each
logical block (block_size tokens), one block id per group, interleaved: entry i * G + g is
group g's block for logical block i. A sliding group's blocks that fall out of its window are
freed as the request advances (their entries become NULL_BLOCK, a block no request ever gets);
full groups keep all theirs. The prefix cache registers each group's blocks under the same
chained hashes; a hit needs every full group's blocks of the prefix and each sliding group's
blocks of its window before the hit's end. Only the first group's blocks are announced as KV
events, so a router sees each prefix once. With one group (no window) all of this reduces to
one block id per logical block.

With tiers below the pool (engine.kv_tiers: a host tier, a disk tier) a cached block evicted from
the pool goes down to them, a prompt's prefix found there is loaded back into fresh blocks
instead of recomputed, and newly cached blocks are written through to disk. The tiers keep each
group's block under its chained hash apart, as the pool does; a lookup takes a group's block
from them only where the hit needs it (a full group's for the whole prefix, a sliding group's
within its window before the hit's end), and only a hit every group can serve is loaded.

A request may pin its prompt's full blocks for a TTL (engine.kv_tiers.pins): a pinned block
that drops to refcount 0 is parked in the pool, neither free nor evictable, until its pin ends;
pins hold at most a share of the pool, and a prompt past that bound is pinned only up to it;
pins give way (first pinned first) to a request that would not fit in the pool otherwise: with
a tier below the pool they move down to it, still pinned; without one they lose their pins.

This module only moves block ids around: it never touches KV tensors (the executor owns them)
and never decides which request runs or gets preempted (the scheduler does).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from common.block_hash import hash_block
from engine.core.kv_events import BlockRemoved, BlockStored, KVEvent
from engine.core.request import Request
from engine.kv_tiers.book import TIER_BLOCK, TierBook
from engine.kv_tiers.pins import MAX_PINNED_SHARE, POOL_BOUND, PinBook

logger = logging.getLogger(__name__)

# The table entry of a sliding group's block freed out of its window (when any group slides,
# block 0 is kept out of the pool for it). Backends never read it: it lies outside the window.
NULL_BLOCK = 0


@dataclass(frozen=True)
class KVGroups:
    """How a model's layers share the paged KV cache (see the module docstring)."""

    # Per group: its sliding window, or None for full attention. Full groups first.
    windows: tuple[int | None, ...]
    # Per layer: its group, and which of the num_slots cache tensors holds its K/V (the layers
    # sharing a tensor are in different groups, so a block id is only ever one group's).
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def tokens_held(self, num_blocks: int, block_size: int, chunk: int) -> int:
        """The longest request a pool of num_blocks holds alone, prefilled in chunks of at most
        `chunk` tokens: a full group needs a block per block_size tokens, a sliding group at
        most the blocks its window and a chunk span; the pool keeps NULL_BLOCK out. Only
        sliding groups: any length, once their spans fit."""
        spans = [None if w is None else -(-(w + chunk) // block_size) + 1 for w in self.windows]
        sliding = [span for span in spans if span is not None]
        available = num_blocks - (1 if sliding else 0)

        def needed(logical: int) -> int:
            return sum(logical if span is None else min(logical, span) for span in spans)

        if len(sliding) == len(spans) and needed(max(sliding)) <= available:
            return 2**62
        # needed() grows with the length and is at least it: the answer is within available.
        low, high = 0, max(available, 0)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if needed(middle) <= available else (low, middle - 1)
        return low * block_size


def kv_groups(layer_windows: Sequence[int | None], num_layers: int) -> KVGroups:
    """The KV groups of a model whose layer i slides over layer_windows[i] positions (None:
    full attention; an empty list: every layer attends fully)."""
    windows = list(layer_windows) or [None] * num_layers
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if len(kinds) == 1:
        return KVGroups(tuple(kinds), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    size = min(windows.count(kind) for kind in kinds)
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * num_layers, [0] * num_layers
    for kind in kinds:
        layers = [i for i, w in enumerate(windows) if w == kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(kind)
    return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


def num_blocks_for_budget(
    memory_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype_bytes: int,
) -> int:
    """How many blocks (K and V, of `num_layers` layers: a KV group's cache slots) fit in
    `memory_bytes`."""
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
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: Sequence[int | None] = (None,),
        tiers: TierBook | None = None,
    ) -> None:
        """`windows`: the KV groups' (KVGroups.windows); one full group by default. `tiers`:
        the books of the tiers below the pool."""
        self.tiers = tiers
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        sliding = any(w is not None for w in self.windows)
        if num_blocks < 1 + sliding:
            raise ValueError(f"num_blocks must be >= {1 + sliding}, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # NULL_BLOCK stays out of the pool where sliding groups use it (elsewhere no table
        # entry is ever null: -1 matches none).
        self._null = NULL_BLOCK if sliding else -1
        self._free: deque[int] = deque(range(int(sliding), num_blocks))
        self._usable = len(self._free)
        # Refcount-0 blocks still registered in the cache; the first entry is evicted first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Refcount-0 cached blocks whose hash is pinned: kept until the pin ends.
        self._parked: dict[int, None] = {}
        # Counted in hashes: each holds one block per group.
        self.pins = PinBook(int(self._usable * MAX_PINNED_SHARE) // self.num_groups)
        if tiers is not None:
            tiers.track_pins(self.pins)
        # (group, chained hash) -> the group's block registered under it.
        self._cached: dict[tuple[int, bytes], int] = {}
        self._block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks
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
    def num_used_blocks(self) -> int:
        """Blocks held by live requests' tables."""
        return self._usable - self.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self._usable

    @property
    def num_pinned(self) -> int:
        """Block hashes pinned now (the pins whose TTL ended are taken first)."""
        self._unpin_expired()
        return self.pins.num_pinned

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
        size, groups, tiers = self.block_size, range(self.num_groups), self.tiers
        full = [g for g in groups if self.windows[g] is None]
        # Per logical block of the prompt (its last token left out), each group's block: its
        # cached pool block, TIER_BLOCK where a tier below holds it (loaded into a fresh block
        # when allocated), None where neither does. The full groups' are looked for block by
        # block up to the first that one lacks; the sliding groups' in the tiers only where a
        # hit would read them (`sliding_hit`).
        rows: list[list[int | None]] = []
        hashes: list[bytes] = []
        parent = request.hash_root
        for i in range((len(tokens) - 1) // size):
            parent = hash_block(parent, tokens[i * size : (i + 1) * size])
            row = [self._cached.get((g, parent)) for g in groups]
            for g in full:
                if row[g] is None and tiers is not None and tiers.holds(parent, g):
                    row[g] = TIER_BLOCK
            if any(row[g] is None for g in full):
                break
            rows.append(row)
            hashes.append(parent)
        sliding = [g for g in groups if self.windows[g] is not None]
        asked: set[tuple[int, int]] = set()  # (logical block, sliding group) asked of the tiers

        def sliding_hit(limit: int) -> int:
            """The longest prefix of at most `limit` blocks whose last blocks every sliding
            group holds as far as it looks back (asking the tiers for those the pool lacks).
            A hit that misses block j of a group misses it in every longer one that reads it
            (windows only move forward): the next to try is j blocks long."""
            hit = limit
            while hit > 0:
                for g in sliding:
                    missing = self._last_missing(g, hit, rows, hashes, asked)
                    if missing >= 0:
                        hit = missing
                        break
                else:
                    return hit
            return 0

        hit = sliding_hit(len(rows))
        if tiers is not None:
            # With tensor parallelism a block found on rank 0's disk counts only if every rank
            # holds it: a full group's lacking ends the prefix there, a sliding group's is
            # missing, and the hit is found again (any block the tiers were asked for meanwhile
            # is asked of the ranks in turn).
            index = {block_hash: i for i, block_hash in enumerate(hashes)}
            while lacking := tiers.lacking_on_some_rank():
                for block_hash, g in lacking:
                    i = index[block_hash]
                    if i < len(rows):
                        rows[i][g] = None
                        if g in full:
                            del rows[i:]
                hit = sliding_hit(min(hit, len(rows)))
        blocks = [
            self._null if i < self._first_seen(g, hit * size) else rows[i][g]
            for i in range(hit)
            for g in groups
        ]
        return cast(list[int], blocks), hit * size

    def _last_missing(
        self,
        group: int,
        hit: int,
        rows: list[list[int | None]],
        hashes: list[bytes],
        asked: set[tuple[int, int]],
    ) -> int:
        """The last of the blocks a hit of `hit` logical blocks reads of sliding group `group`
        that neither the pool nor a tier holds (the tiers asked once per block, newest first);
        -1 when it has them all."""
        for i in range(hit - 1, self._first_seen(group, hit * self.block_size) - 1, -1):
            if rows[i][group] is None and self.tiers is not None and (i, group) not in asked:
                asked.add((i, group))
                if self.tiers.holds(hashes[i], group):
                    rows[i][group] = TIER_BLOCK
            if rows[i][group] is None:
                return i
        return -1

    def _first_seen(self, group: int, num_computed: int) -> int:
        """The first logical block group `group` still reads once num_computed tokens are
        computed: 0 for a full group, else the block where the next token's window starts."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow request.block_table to cover `num_new_tokens` more tokens; all or nothing.

        `cached_blocks` (from get_cached_prefix just before) may only be given while the
        request holds no blocks; they then count as its computed tokens.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        self._unpin_expired()
        if cached_blocks and request.block_table:
            raise ValueError(
                f"request {request.request_id} already holds blocks; cannot take cached ones"
            )
        groups = self.num_groups
        table = request.block_table
        num_computed = (
            len(cached_blocks) // groups * self.block_size
            if cached_blocks
            else request.num_computed_tokens
        )
        # Blocks behind every future token's window go back now (computed tokens only grow).
        self._free_out_of_window(request, num_computed)
        num_held = (len(table) + len(cached_blocks)) // groups
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_fresh = max(0, num_needed - num_held) * groups
        # The blocks the new tokens start in, if partly written and shared (a forked prompt's
        # last block): each must be copied before this request writes into it.
        first_new = num_computed // self.block_size
        shared = []
        if num_new_tokens != 0 and first_new < len(table) // groups:
            shared = [
                first_new * groups + g
                for g in range(groups)
                if table[first_new * groups + g] != self._null
                and self._ref_counts[table[first_new * groups + g]] != 1
            ]
        if self._parked:  # off the hot path while nothing is pinned
            held = sum(1 for block in (*table, *cached_blocks) if block != self._null)
            self._yield_pins(request, held + num_fresh + len(shared), cached_blocks)
        # Taking an evictable cached block removes it from what fresh blocks can come from.
        num_revived = sum(1 for block in cached_blocks if block in self._evictable)
        num_loaded = cached_blocks.count(TIER_BLOCK)
        if num_fresh + len(shared) + num_loaded > self.num_free_blocks - num_revived:
            return False

        if self.enable_prefix_caching and not table:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed if cached_blocks else 0
        for block in cached_blocks:
            if block not in (self._null, TIER_BLOCK):
                if self._ref_counts[block] == 0:
                    if block in self._evictable:
                        del self._evictable[block]
                    else:
                        del self._parked[block]
                self._ref_counts[block] += 1
            table.append(block)
        # The hit's chained hashes (a sliding group's early blocks are not in the table).
        parent, tokens, size = request.hash_root, request.token_ids, self.block_size
        for i in range(len(cached_blocks) // groups):
            parent = hash_block(parent, tokens[i * size : (i + 1) * size])
            request.block_hashes.append(parent)
        # A lower tier's blocks are claimed before this allocation evicts anything down to it.
        loads = [
            (i, cast(TierBook, self.tiers).claim(request.block_hashes[i // groups], i % groups))
            for i, block in enumerate(cached_blocks)
            if block == TIER_BLOCK
        ]
        for i, origin in loads:
            block = table[i] = self._take_fresh()
            cast(TierBook, self.tiers).load(origin, block)
            self._register(block, i, request)
        for _ in range(num_fresh):
            table.append(self._take_fresh())
        for entry in shared:
            source = table[entry]
            self._ref_counts[source] -= 1  # others still hold it: never 0 here
            copy = table[entry] = self._take_fresh()
            # A destination freed and taken again this step keeps only its latest copy.
            self._copies[copy] = source
        return True

    def _free_out_of_window(self, request: Request, num_computed: int) -> None:
        """Releases each sliding group's blocks before its window (entries become NULL_BLOCK),
        back to front from the newest such block: those before it went earlier."""
        table, groups = request.block_table, self.num_groups
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            i = min(self._first_seen(g, num_computed), len(table) // groups) - 1
            while i >= 0 and table[i * groups + g] != self._null:
                self._release(table[i * groups + g])
                table[i * groups + g] = self._null
                i -= 1

    def _register(self, block: int, entry: int, request: Request) -> None:
        """Register a block loaded from a tier into table entry `entry` under its group and
        hash; the first group's as BlockStored."""
        index, group = divmod(entry, self.num_groups)
        block_hash, size = request.block_hashes[index], self.block_size
        self._cached[group, block_hash] = block
        self._block_hash[block] = (group, block_hash)
        if group != 0:
            return
        parent = request.block_hashes[index - 1] if index else request.hash_root
        tokens = request.token_ids[index * size : (index + 1) * size]
        lora = request.lora_name or ""
        self._kv_events.append(BlockStored([block_hash], parent, tokens, size, lora_name=lora))

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            key = self._block_hash[block]
            if key is None:
                self._free.append(block)
            elif self.pins.is_pinned(key[1]):
                self._parked[block] = None
            else:
                self._evictable[block] = None

    def _pin_prompt(self, request: Request) -> None:
        """Pin the request's hashed prompt blocks not pinned yet (clipped at the bounds)."""
        prompt_blocks = len(request.prompt_token_ids) // self.block_size
        for i in range(request.num_pinned_blocks, min(prompt_blocks, len(request.block_hashes))):
            block_hash = request.block_hashes[i]
            refused = self.pins.pin(
                block_hash, request.pin_ttl_seconds, request.pin_owner, request.pin_owner_max_blocks
            )
            if refused is not None:
                if refused == POOL_BOUND:
                    bound = (
                        f"pins already hold {self.pins.max_blocks} blocks, the bound "
                        f"({MAX_PINNED_SHARE:.0%} of the KV pool)"
                    )
                else:
                    bound = (
                        f"its owner {request.pin_owner or 'anonymous'!r} already pins "
                        f"{request.pin_owner_max_blocks} blocks, the bound per API key "
                        "(the gateway's --max-pinned-gib-per-key)"
                    )
                logger.warning(
                    "request %s: pinned %d of its %d prompt blocks; %s",
                    request.request_id,
                    i,
                    prompt_blocks,
                    bound,
                )
                request.num_pinned_blocks = prompt_blocks  # clipped: not tried again
                return
            # Another block may be the cached copy of this content: keep that one too.
            for g in range(self.num_groups):
                block = self._cached.get((g, block_hash))
                if block is not None and block in self._evictable:
                    del self._evictable[block]
                    self._parked[block] = None
            request.num_pinned_blocks = i + 1

    def _unpin_expired(self) -> None:
        """Blocks whose pins ended become evictable again (most recently used last)."""
        for block_hash in self.pins.expire():
            self._unpark(block_hash)

    def _unpark(self, block_hash: bytes, evict_first: bool = False) -> None:
        for g in range(self.num_groups):
            block = self._cached.get((g, block_hash))
            if block is not None and block in self._parked:
                del self._parked[block]
                self._evictable[block] = None
                if evict_first:
                    self._evictable.move_to_end(block, last=False)

    def _yield_pins(self, request: Request, total: int, keep: Sequence[int]) -> None:
        """Pins never keep a request out of a pool it would fit in alone: when its `total`
        blocks exceed the pool less the parked blocks (other than `keep`, its own hit), the
        first parked blocks become the first evicted. With a tier below the pool they keep
        their pins there (the host tier drops them last; the disk tier has them already);
        without one they lose their pins."""
        own = sum(1 for block in keep if block in self._parked)
        excess = total - (self._usable - len(self._parked) + own)
        if excess <= 0:
            return
        victims = [block for block in self._parked if block not in keep][:excess]
        logger.warning(
            "request %s needs %d KV blocks, more than the pool less its pinned blocks: %d "
            "pinned blocks %s",
            request.request_id,
            total,
            len(victims),
            "move down a tier" if self.tiers is not None else "lose their pins",
        )
        for block in victims:
            if block not in self._parked:  # another group's block of a hash unparked here
                continue
            block_hash = cast(tuple[int, bytes], self._block_hash[block])[1]
            if self.tiers is None:
                self.pins.unpin(block_hash)
            self._unpark(block_hash, evict_first=True)

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` (holding no blocks) the parent's blocks by reference, with the prefix
        cache hashes of the full ones: it continues from the parent's computed tokens."""
        if child.block_table:
            raise ValueError(
                f"request {child.request_id} already holds blocks; cannot fork into it"
            )
        for block in parent.block_table:
            if block != self._null:
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
        size, groups = self.block_size, self.num_groups
        tokens, table = request.token_ids, request.block_table
        hashes = request.block_hashes
        num_full = min(num_computed_tokens // size, len(table) // groups)
        stored: BlockStored | None = None  # this call's current run of newly cached blocks
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else request.hash_root
            block_tokens = tokens[i * size : (i + 1) * size]
            block_hash = hash_block(parent, block_tokens)
            hashes.append(block_hash)
            for g in range(groups):
                block = table[i * groups + g]
                # Another block may already hold this content; keep that one as the cached
                # copy. A block freed out of its window is not there to register.
                if block == self._null or (g, block_hash) in self._cached:
                    continue
                self._cached[g, block_hash] = block
                self._block_hash[block] = (g, block_hash)
                if self.tiers is not None:
                    self.tiers.registered(block, block_hash, g)
                if g != 0:
                    continue  # routers hear of each prefix once: the first group's blocks
                if stored is None or stored.block_hashes[-1] != parent:
                    stored = BlockStored([], parent, [], size, lora_name=request.lora_name or "")
                    self._kv_events.append(stored)
                stored.block_hashes.append(block_hash)
                stored.token_ids += block_tokens
        if request.pin_ttl_seconds > 0:
            self._pin_prompt(request)

    def trim(self, request: Request, num_tokens: int) -> bool:
        """Release the request's blocks past those holding its first `num_tokens` tokens (the
        blocks only its rejected drafts reached: never hashed, so never announced); False if
        there were none."""
        keep = -(-num_tokens // self.block_size) * self.num_groups
        table = request.block_table
        if len(table) <= keep:
            return False
        for block in reversed(table[keep:]):
            if block != self._null:
                self._release(block)
        del table[keep:]
        return True

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first so that eviction drops tails first."""
        for block in reversed(request.block_table):
            if block != self._null:
                self._release(block)
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

    def announced_hashes(self) -> set[bytes]:
        """The chained hashes of the first group's cached blocks: what the KV events so far
        announce as held."""
        return {block_hash for group, block_hash in self._cached if group == 0}

    def take_kv_events(self) -> list[KVEvent]:
        """The blocks stored in and removed from the prefix cache since the last call, in
        order; clears them."""
        events, self._kv_events = self._kv_events, []
        # The host tier's after the pool's: each medium's own order is kept.
        return events + self.tiers.take_events() if self.tiers is not None else events

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        if self.tiers is not None:
            group, block_hash = cast(tuple[int, bytes], self._block_hash[block])
            self.tiers.evicted(block, block_hash, group)
        self._uncache(block)
        return block

    def _uncache(self, block: int) -> None:
        key = self._block_hash[block]
        if key is None:
            raise RuntimeError(f"block {block} is not registered in the prefix cache")
        del self._cached[key]
        self._block_hash[block] = None
        group, block_hash = key
        if group != 0:
            return
        # Evictions in a row (one allocation, a reset) are one event.
        last = self._kv_events[-1] if self._kv_events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._kv_events.append(BlockRemoved([block_hash]))
