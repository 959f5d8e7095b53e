"""Sliding-window models end to end: the KV cache groups a hybrid model's layers, frees a
sliding group's blocks once they fall behind its window and keeps prefix caching correct across
both kinds of groups; greedy tokens equal transformers' (float32) over prompts longer than the
window (3 positions, blocks of 4) through chunked prefill, prefix hits and preemption, every
layer's attention (gpt-oss's sinks included) through Folio's C++ kernel where it loads."""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, kv_groups
from engine.core.kv_events import BlockStored
from engine.core.request import Request
from engine.engine import LLMEngine
from engine.kernels.cpu.capabilities import cpu_capabilities
from tiny_models import MOE_VARIANTS, VARIANTS, hf_greedy, make_checkpoint

BLOCK = 4


def test_groups_hold_one_kind_of_layer_and_share_the_slots():
    # Gemma 3 1B's layout: 26 layers, every sixth global.
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = kv_groups(windows, 26)
    assert groups.windows == (None,) + (512,) * 6 and groups.num_slots == 4
    pairs = list(zip(groups.layer_group, groups.layer_slot, strict=True))
    assert len(set(pairs)) == 26 and max(groups.layer_slot) == 3
    for layer, (group, _) in enumerate(pairs):
        assert groups.windows[group] == windows[layer]
    # One kind of attention: one group, a slot per layer (the layout without windows).
    assert kv_groups([], 3) == kv_groups([None] * 3, 3)
    assert kv_groups([7] * 3, 3).windows == (7,) and kv_groups([7] * 3, 3).num_slots == 3


def request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64, ignore_eos=True))


def advance(manager: KVCacheManager, req: Request, count: int) -> None:
    """One step of `count` new tokens: allocate, compute, register full blocks."""
    assert manager.allocate(req, count)
    req.num_computed_tokens += count
    manager.cache_blocks(req, req.num_computed_tokens)


def live(table: list[int], group: int, groups: int) -> list[int]:
    return [b for b in table[group::groups] if b != NULL_BLOCK]


def test_a_sliding_group_keeps_only_its_window():
    manager = KVCacheManager(64, BLOCK, windows=(None, 6))
    req = request(list(range(100)))
    for _ in range(5):  # a 100-token prompt in chunks of 20
        advance(manager, req, 20)
        # Full group: every block; sliding: the window (6) and a chunk (20) at most.
        assert len(live(req.block_table, 0, 2)) == 25 if req.num_computed_tokens == 100 else True
        assert len(live(req.block_table, 1, 2)) <= -(-(6 + 20) // BLOCK) + 1
    for _ in range(30):  # decodes
        req.append_output(1)
        advance(manager, req, 1)
        assert len(live(req.block_table, 1, 2)) <= 3
    assert len(live(req.block_table, 0, 2)) == -(-req.num_computed_tokens // BLOCK)
    assert manager.num_used_blocks == len(live(req.block_table, 0, 2)) + len(
        live(req.block_table, 1, 2)
    )
    manager.free(req)
    assert manager.num_used_blocks == 0 and manager.usage == 0


def test_a_prefix_hit_needs_each_sliding_group_s_window():
    manager = KVCacheManager(64, BLOCK, windows=(None, 5))
    first = request(list(range(21)), "a")
    advance(manager, first, 21)
    first.append_output(99)
    advance(manager, first, 1)  # its sliding blocks 0..3 fall behind the window
    assert first.block_table[1 : 4 * 2 : 2] == [NULL_BLOCK] * 4
    events = manager.take_kv_events()
    # Routers hear of the first group's blocks only.
    assert [len(e.block_hashes) for e in events if isinstance(e, BlockStored)] == [5]
    manager.free(first)

    second = request([*range(20), 7, 8, 9], "b")
    blocks, hit = manager.get_cached_prefix(second)
    assert hit == 20  # 5 blocks: the full group's all, the sliding group's last one
    assert blocks[0::2] == first_blocks_of(manager, list(range(20)), 0)
    assert blocks[1::2][:4] == [NULL_BLOCK] * 4 and blocks[9] != NULL_BLOCK
    assert manager.allocate(second, 3, blocks)
    second.num_computed_tokens = hit
    assert len(second.block_hashes) == 5


def first_blocks_of(manager: KVCacheManager, tokens: list[int], group: int) -> list[int]:
    probe = request([*tokens, 0], "probe")
    blocks, _ = manager.get_cached_prefix(probe)
    return blocks[group :: manager.num_groups]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def engine_on(directory, num_blocks: int, tp: int = 1) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            dtype="float32",
            block_size=BLOCK,
            num_kv_blocks=num_blocks,
            max_num_batched_tokens=12,
            max_num_seqs=4,
            tensor_parallel_size=tp,
        )
    )


def greedy(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Every prompt's GREEDY tokens, all queued at once."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def watch_attention(engine: LLMEngine) -> list[list[bool]]:
    """For each layer's attention the engine runs from now on: [went through Folio's C++
    kernel, had sinks]. The backend's own calls, watched on their way (nothing replaced)."""
    backend = engine.executor.runner.model.backend
    forward, kernel = backend.forward, backend._kernel
    calls: list[list[bool]] = []

    def watched_forward(q, k, v, kv_cache, meta, scale, window=None, sinks=None):
        calls.append([False, sinks is not None])
        return forward(q, k, v, kv_cache, meta, scale, window, sinks)

    def watched_kernel(*args):
        calls[-1][0] = True
        return kernel(*args)

    backend.forward = watched_forward
    if kernel is not None:
        backend._kernel = watched_kernel
    return calls


# Gemma 3 and gpt-oss get too few blocks for all four requests at once: the last admitted are
# preempted and recomputed. A sliding-only model holds a few blocks a request, freed as fast as
# it takes new ones: it runs in a small pool without preemption.
@pytest.mark.parametrize(
    "variant, num_blocks, preempts",
    [("gemma3-window3", 40, True), ("gpt-oss", 24, True), ("mistral-window3", 10, False)],
)
def test_greedy_tokens_through_preemption_and_prefix_hits(tmp_path, variant, num_blocks, preempts):
    reference = make_checkpoint(tmp_path, *{**VARIANTS, **MOE_VARIANTS}[variant])
    engine = engine_on(tmp_path, num_blocks)
    calls = watch_attention(engine)
    base = [(7 * i) % 150 + 3 for i in range(30)]
    prompts = {"a": base, "b": [*base[:22], 5, 6, 7], "c": base[::-1], "d": base[3:29]}
    got = greedy(engine, prompts)
    assert calls and all(sinks == (variant == "gpt-oss") for _, sinks in calls)
    assert all(kernel == cpu_capabilities().folio_kernels for kernel, _ in calls)
    for rid, ids in prompts.items():
        assert got[rid] == hf_greedy(reference, ids, 10), rid
    assert engine.kv_cache.prefix_cache_hits > 0
    assert (engine.scheduler.num_preemptions > 0) == preempts
    assert engine.kv_cache.usage == 0


# Each new architecture at TP=2 (worker ranks as subprocesses): Phi-3's stacked qkv_proj and
# gate_up_proj split by rank, Gemma 3's KV groups in each rank's cache, gpt-oss's sinks split
# with their heads and its experts' down biases added by one rank.
@pytest.mark.parametrize("variant", ["phi3-longrope", "gemma3-window3", "gpt-oss"])
def test_two_ranks_give_transformers_greedy_tokens(tmp_path, variant):
    reference = make_checkpoint(tmp_path, *{**VARIANTS, **MOE_VARIANTS}[variant])
    engine = engine_on(tmp_path, 64, tp=2)
    base = [(5 * i) % 150 + 3 for i in range(26)]
    prompts = {"a": base, "b": [*base[:21], 9, 8]}
    try:
        got = greedy(engine, prompts)
    finally:
        engine.close()
    for rid, ids in prompts.items():
        assert got[rid] == hf_greedy(reference, ids, 10), rid


def test_the_longest_request_a_pool_holds():
    full_and_sliding = kv_groups([None, None, 8, 8], 4)  # a full group, a sliding group
    assert full_and_sliding.windows == (None, 8) and full_and_sliding.num_slots == 2
    # 40 blocks, NULL_BLOCK apart: the sliding group needs (8 + 4) / 4 + 1 = 4 at most.
    assert full_and_sliding.tokens_held(40, BLOCK, chunk=4) == (39 - 4) * BLOCK
    # Sliding layers only: any length once the window fits, however long the window.
    assert kv_groups([8, 8], 2).tokens_held(8, BLOCK, chunk=4) == 2**62
    assert kv_groups([262144] * 2, 2).tokens_held(100, BLOCK, chunk=4) == 99 * BLOCK
    assert kv_groups([], 2).tokens_held(10, BLOCK, chunk=4) == 10 * BLOCK
