"""KV cache manager: block accounting, prefix caching and eviction.

A hypothesis state machine drives the manager like a scheduler and executor would (admit with
a prefix lookup, chunked prefill, decode, free, reset) and checks it against a shadow model
of what each physical block holds; plain examples pin down the documented behaviours.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.block_hash import ROOT_HASH, prefix_block_hashes
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import KVCacheManager, num_blocks_for_budget
from engine.core.request import Request

BLOCK_SIZE = 4
NUM_BLOCKS = 12
# Prompts start with a cut of one of these (then random tokens from the same small alphabet),
# so that prefixes, partial matches and duplicate blocks are common.
SHARED_PREFIXES = [[0, 1, 2, 0] * 5, [0, 1, 2, 0] * 2 + [1, 1, 1, 1] * 3, [2] * 20]


def make_request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(
        request_id=request_id, prompt_token_ids=list(tokens), sampling_params=SamplingParams()
    )


def run_prefill(manager: KVCacheManager, request: Request) -> None:
    """Admit a request with its prefix hit and compute all of its tokens."""
    blocks, num_cached = manager.get_cached_prefix(request)
    assert manager.allocate(request, request.num_tokens - num_cached, blocks)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def snapshot(manager: KVCacheManager, requests: list[Request]) -> object:
    return copy.deepcopy(
        (
            manager._ref_counts,
            list(manager._free),
            list(manager._evictable),
            manager._cached,
            manager._block_hash,
            [(r.block_table, r.block_hashes, r.num_computed_tokens) for r in requests],
        )
    )


class KVCacheMachine(RuleBasedStateMachine):
    """Shadow model: `content[b]` is what the executor wrote into block b's slots."""

    prefix_caching = True

    @initialize()
    def setup(self) -> None:
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, self.prefix_caching)
        self.live: list[Request] = []
        self.content: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        # Every block hash ever seen -> the whole token prefix it stands for (and back).
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}
        self.hash_of: dict[tuple[int, ...], bytes] = {}
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------------------

    def allocate_checked(self, request: Request, num_new: int, cached_blocks: list[int]) -> bool:
        others = [r for r in self.live if r is not request]
        before = snapshot(self.manager, [request, *others])
        held_elsewhere = {b for r in others for b in r.block_table}
        old_len = len(request.block_table)
        ok = self.manager.allocate(request, num_new, cached_blocks)
        if not ok:
            assert snapshot(self.manager, [request, *others]) == before, (
                "failed allocate changed state"
            )
            # Failure is only allowed when the blocks truly are not there.
            revived = sum(1 for b in cached_blocks if b not in held_elsewhere)
            start = (
                len(cached_blocks) * BLOCK_SIZE if cached_blocks else request.num_computed_tokens
            )
            needed = -(-(start + num_new) // BLOCK_SIZE) - old_len - len(cached_blocks)
            assert needed > self.manager.num_free_blocks - revived
            return False
        assert request.block_table[old_len : old_len + len(cached_blocks)] == cached_blocks
        fresh = request.block_table[old_len + len(cached_blocks) :]
        assert len(set(fresh)) == len(fresh)
        for block in fresh:
            assert block not in held_elsewhere, f"referenced block {block} handed out again"
            assert block not in request.block_table[: old_len + len(cached_blocks)]
            assert block not in self.manager._cached.values(), "fresh block still registered"
        start = len(cached_blocks) * BLOCK_SIZE if cached_blocks else request.num_computed_tokens
        assert len(request.block_table) * BLOCK_SIZE >= start + num_new
        return True

    def compute(self, request: Request, num_new: int) -> None:
        """What the executor does: write KV for the next tokens, then report them computed."""
        start = request.num_computed_tokens
        for pos in range(start, start + num_new):
            block = request.block_table[pos // BLOCK_SIZE]
            self.content[block][pos % BLOCK_SIZE] = request.token_ids[pos]
        request.num_computed_tokens += num_new
        self.manager.cache_blocks(request, request.num_computed_tokens)
        if self.prefix_caching:
            assert len(request.block_hashes) == request.num_computed_tokens // BLOCK_SIZE
            for i, block_hash in enumerate(request.block_hashes):
                prefix = tuple(request.token_ids[: (i + 1) * BLOCK_SIZE])
                assert self.prefix_of.setdefault(block_hash, prefix) == prefix, "hash collision"
                assert self.hash_of.setdefault(prefix, block_hash) == block_hash, (
                    "hash not a function"
                )
        else:
            assert request.block_hashes == []

    def release(self, request: Request) -> None:
        self.manager.free(request)
        assert request.block_table == [] and request.block_hashes == []
        self.live.remove(request)

    # -- rules ------------------------------------------------------------------------------

    @rule(
        shared=st.sampled_from(SHARED_PREFIXES),
        cut=st.integers(0, 5 * BLOCK_SIZE),
        tail=st.lists(st.integers(0, 2), max_size=3 * BLOCK_SIZE),
        chunk=st.integers(1, 6 * BLOCK_SIZE),
    )
    def admit(self, shared: list[int], cut: int, tail: list[int], chunk: int) -> None:
        prompt = shared[:cut] + tail
        if not prompt:
            return
        request = make_request(prompt, f"r{self.next_id}")
        self.next_id += 1
        queries, hits = self.manager.prefix_cache_queries, self.manager.prefix_cache_hits
        blocks, num_cached = self.manager.get_cached_prefix(request)
        # Looking up alone counts nothing: a request is counted when admitted.
        assert (self.manager.prefix_cache_queries, self.manager.prefix_cache_hits) == (
            queries,
            hits,
        )
        assert num_cached == len(blocks) * BLOCK_SIZE
        assert len(blocks) <= (len(prompt) - 1) // BLOCK_SIZE
        for i, block in enumerate(blocks):
            assert self.content[block] == prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], (
                "bad prefix hit"
            )
        # The hit is the longest: the next block's prefix is not cached.
        if self.prefix_caching and len(blocks) < (len(prompt) - 1) // BLOCK_SIZE:
            nxt = self.hash_of.get(tuple(prompt[: (len(blocks) + 1) * BLOCK_SIZE]))
            assert nxt is None or (0, nxt) not in self.manager._cached

        num_new = min(len(prompt) - num_cached, chunk)
        if self.allocate_checked(request, num_new, blocks):
            if self.prefix_caching:
                assert self.manager.prefix_cache_queries == queries + len(prompt)
                assert self.manager.prefix_cache_hits == hits + num_cached
            request.num_computed_tokens = num_cached
            self.live.append(request)
            self.compute(request, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 3 * BLOCK_SIZE), token=st.integers(0, 2))
    def step(self, data: st.DataObject, chunk: int, token: int) -> None:
        """Continue a chunked prefill, or decode one token once the prompt is done."""
        request = data.draw(st.sampled_from(self.live))
        if request.num_computed_tokens == request.num_tokens:
            request.append_output(token)
        num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
        if self.allocate_checked(request, num_new, []):
            self.compute(request, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.release(data.draw(st.sampled_from(self.live)))

    @rule()
    def free_all(self) -> None:
        for request in list(self.live):
            self.release(request)
        assert self.manager.num_free_blocks == NUM_BLOCKS
        assert self.manager.usage == 0.0

    @rule()
    def reset_prefix_cache(self) -> None:
        had_evictable = len(self.manager._evictable) > 0
        assert self.manager.reset_prefix_cache() == had_evictable
        assert not self.manager._evictable

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def blocks_partitioned(self) -> None:
        manager = self.manager
        free, evictable = list(manager._free), list(manager._evictable)
        referenced = [b for b in range(NUM_BLOCKS) if manager._ref_counts[b] > 0]
        assert len(free) + len(evictable) + len(referenced) == NUM_BLOCKS
        assert set(free) | set(evictable) | set(referenced) == set(range(NUM_BLOCKS))
        assert manager.num_free_blocks == len(free) + len(evictable)
        assert manager.usage == pytest.approx(len(referenced) / NUM_BLOCKS)

    @invariant()
    def refcounts_match_tables(self) -> None:
        for block in range(NUM_BLOCKS):
            holders = sum(r.block_table.count(block) for r in self.live)
            assert self.manager._ref_counts[block] == holders

    @invariant()
    def cache_consistent(self) -> None:
        manager = self.manager
        if not self.prefix_caching:
            assert not manager._cached and not manager._evictable
        assert {h: b for b, h in enumerate(manager._block_hash) if h is not None} == manager._cached
        assert all(manager._block_hash[b] is not None for b in manager._evictable)
        assert all(manager._block_hash[b] is None for b in manager._free)
        for (_, block_hash), block in manager._cached.items():
            assert self.content[block] == list(self.prefix_of[block_hash][-BLOCK_SIZE:])

    @invariant()
    def tables_cover_computed_tokens(self) -> None:
        for request in self.live:
            assert len(request.block_table) * BLOCK_SIZE >= request.num_computed_tokens
            for pos in range(request.num_computed_tokens):
                block = request.block_table[pos // BLOCK_SIZE]
                assert self.content[block][pos % BLOCK_SIZE] == request.token_ids[pos]

    def teardown(self) -> None:
        if hasattr(self, "manager"):
            self.free_all()


class KVCacheMachineNoPrefixCaching(KVCacheMachine):
    prefix_caching = False


TestKVCacheManagerStateful = KVCacheMachine.TestCase
TestKVCacheManagerStateful.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestKVCacheManagerNoPrefixCachingStateful = KVCacheMachineNoPrefixCaching.TestCase
TestKVCacheManagerNoPrefixCachingStateful.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)


# -- examples ---------------------------------------------------------------------------------


def test_prefix_hit_after_free_reuses_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request(list(range(10)), "a")
    run_prefill(manager, first)
    full_blocks, full_hashes = first.block_table[:2], list(first.block_hashes)
    manager.free(first)

    second = make_request([*range(8), 99, 98, 97], "b")
    blocks, num_cached = manager.get_cached_prefix(second)
    assert (blocks, num_cached) == (full_blocks, 8)
    assert manager.allocate(second, second.num_tokens - num_cached, blocks)
    assert manager.prefix_cache_queries == 10 + 11 and manager.prefix_cache_hits == 8
    assert second.block_table[:2] == full_blocks and len(second.block_table) == 3
    assert second.block_hashes == full_hashes
    assert manager.usage == pytest.approx(3 / 8)


def test_at_least_one_token_left_uncomputed() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    run_prefill(manager, make_request(list(range(12)), "a"))
    # All three blocks are cached, but an exact match must still compute its last token.
    assert manager.get_cached_prefix(make_request(list(range(12))))[1] == 8
    assert manager.get_cached_prefix(make_request(list(range(13))))[1] == 12
    assert manager.get_cached_prefix(make_request(list(range(4))))[1] == 0
    assert manager.get_cached_prefix(make_request([0]))[1] == 0


def test_lru_evicts_sequence_tail_first() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    tokens = list(range(12))
    first = make_request(tokens, "a")
    run_prefill(manager, first)  # 3 full blocks cached
    manager.free(first)
    assert manager.num_free_blocks == 4

    # Needs 2 blocks: the never-used one first, then one eviction, which must hit the tail.
    other = make_request([50 + i for i in range(8)], "b")
    assert manager.allocate(other, 8)
    assert manager.get_cached_prefix(make_request([*tokens, 0]))[1] == 8
    assert manager.allocate(make_request([], "c"), 4)  # evicts the middle block next
    assert manager.get_cached_prefix(make_request([*tokens, 0]))[1] == 4


def test_lru_prefers_least_recently_freed_request() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    old, new = make_request([1] * 4 + [0], "old"), make_request([2] * 4 + [0], "new")
    run_prefill(manager, old)
    run_prefill(manager, new)
    manager.free(old)
    manager.free(new)
    # Two partial blocks went back to the free list; the third block evicts the older request's.
    assert manager.allocate(make_request([], "x"), 12)
    assert manager.get_cached_prefix(make_request([1] * 4 + [0]))[1] == 0
    assert manager.get_cached_prefix(make_request([2] * 4 + [0]))[1] == 4


def test_free_without_blocks_is_a_no_op() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=4)
    run_prefill(manager, make_request(list(range(9)), "a"))
    request = make_request([1, 2], "never-admitted")
    manager.free(request)
    manager.free(request)
    assert manager.num_free_blocks == 0 and manager.usage == 1.0


def test_failed_allocate_counts_revived_cached_blocks() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request(list(range(9)), "a")
    run_prefill(manager, a)
    manager.free(a)  # 2 evictable cached blocks + 1 free
    assert manager.num_free_blocks == 3

    b = make_request(list(range(8)) + [7] * 5, "b")  # 13 tokens: 2 cached + 2 fresh blocks
    blocks, num_cached = manager.get_cached_prefix(b)
    assert num_cached == 8
    before = (list(manager._free), list(manager._evictable), list(manager._ref_counts))
    assert not manager.allocate(b, b.num_tokens - num_cached, blocks)
    assert (list(manager._free), list(manager._evictable), list(manager._ref_counts)) == before
    assert b.block_table == [] and b.block_hashes == []

    c = make_request(list(range(8)) + [7] * 4, "c")  # 12 tokens: 2 cached + 1 fresh fits
    blocks, num_cached = manager.get_cached_prefix(c)
    assert manager.allocate(c, c.num_tokens - num_cached, blocks)
    assert manager.num_free_blocks == 0 and manager.usage == 1.0


def test_duplicate_content_keeps_first_block_cached() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request(list(range(5)), "a"), make_request(list(range(5)), "b")
    for request in (a, b):  # both admitted before either has computed anything
        assert manager.allocate(request, 5)
    for request in (a, b):
        request.num_computed_tokens = 5
        manager.cache_blocks(request, 5)
    assert a.block_hashes == b.block_hashes and a.block_table[0] != b.block_table[0]
    assert manager.get_cached_prefix(make_request(list(range(5))))[0] == [a.block_table[0]]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 4 and manager.usage == 0.0
    assert manager.get_cached_prefix(make_request(list(range(5))))[1] == 4


def test_prefix_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = make_request(list(range(9)), "a")
    run_prefill(manager, a)
    assert a.block_hashes == []
    manager.free(a)
    assert manager.get_cached_prefix(make_request(list(range(9)))) == ([], 0)
    assert manager.prefix_cache_queries == 0 and manager.prefix_cache_hits == 0
    assert not manager.reset_prefix_cache()


def test_reset_prefix_cache_drops_only_unreferenced() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    assert not manager.reset_prefix_cache()
    kept, dropped = make_request([1] * 5, "kept"), make_request([2] * 5, "dropped")
    run_prefill(manager, kept)
    run_prefill(manager, dropped)
    manager.free(dropped)
    assert manager.reset_prefix_cache()
    assert not manager.reset_prefix_cache()
    assert manager.get_cached_prefix(make_request([2] * 5))[1] == 0
    assert manager.get_cached_prefix(make_request([1] * 5))[1] == 4
    assert manager.num_free_blocks == 2


@pytest.mark.parametrize(
    ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"),
    [(2, 4, 64, 16, torch.float16), (30, 3, 64, 16, torch.bfloat16), (1, 1, 8, 4, torch.float32)],
)
def test_num_blocks_for_budget(num_layers, num_kv_heads, head_dim, block_size, dtype) -> None:
    # Reference: the bytes of the tensors the executor would allocate for one block.
    one_block = torch.empty(2, num_layers, block_size, num_kv_heads, head_dim, dtype=dtype).nbytes
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    for num_blocks in (1, 7, 1000):
        for slack in (0, one_block - 1):
            budget = num_blocks * one_block + slack
            got = num_blocks_for_budget(
                budget, num_layers, num_kv_heads, head_dim, block_size, dtype_bytes
            )
            assert got == num_blocks
    with pytest.raises(ValueError, match="cannot hold one block"):
        num_blocks_for_budget(
            one_block - 1, num_layers, num_kv_heads, head_dim, block_size, dtype_bytes
        )


def test_cached_blocks_use_the_shared_chained_hash_and_are_recorded_as_kv_events():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = Request("r", list(range(10, 21)), SamplingParams())
    assert manager.allocate(request, request.num_tokens)
    manager.cache_blocks(request, request.num_tokens)
    expected = prefix_block_hashes(request.token_ids, 4)
    assert request.block_hashes == expected
    [stored] = manager.take_kv_events()
    assert stored.block_hashes == expected and stored.parent_block_hash == ROOT_HASH
    assert stored.token_ids == request.token_ids[:8]
    assert manager.take_kv_events() == []
