"""KV cache tiers on models with sliding-window layers (tiny random-weight float32 models,
windows of 3 positions in blocks of 4): Gemma 3's interleaved layers (a full KV group and three
sliding ones) and Mistral's window on every layer (one sliding group). A prompt's prefix comes
back from the host tier (exact in the native format, the same tokens in int8) and from the disk
tier in a new engine, each group's blocks only as far as the hit reads them (the full group's
all, the sliding groups' the window before its end); a sliding group's missing block makes the
hit shorter, never served; another group layout starts cold and leaves the files alone; with
tensor parallelism both ranks write and agree on every group's blocks."""

from __future__ import annotations

import logging

import pytest
from test_engine import BLOCK, prompt
from test_kv_tiers import (
    FOLLOW_UP,
    INT8_LOGPROB_BOUND,
    SHARED,
    generate,
    make_engine,
    push_out,
    through_the_host_tier,
)

from common.block_hash import prefix_block_hashes
from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, kv_groups
from engine.core.request import Request
from engine.engine import LLMEngine
from engine.kv_tiers.book import TIER_BLOCK, TierBook, tier_key
from engine.kv_tiers.store import KVTierStore
from tiny_models import VARIANTS, hf_greedy, make_checkpoint

HASHES = prefix_block_hashes(FOLLOW_UP, BLOCK)  # SHARED's six blocks, then one more
# Gemma 3's pool: room for a 24-token prompt's blocks of four groups, prefilled in chunks of 16.
GEMMA3 = dict(num_kv_blocks=40, max_num_batched_tokens=16)


def alone(directory, reference) -> tuple[list[int], list[float]]:
    """FOLLOW_UP's greedy tokens (transformers') and logprobs without tiers."""
    tokens, logprobs, _ = generate(make_engine(directory, num_kv_blocks=128), "alone", FOLLOW_UP)
    assert tokens == hf_greedy(reference, FOLLOW_UP, 6)
    return tokens, logprobs


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The checkpoint's directory, and FOLLOW_UP's tokens and logprobs without tiers."""
    directory = tmp_path_factory.mktemp("gemma3")
    return directory, alone(directory, make_checkpoint(directory, *VARIANTS["gemma3-window3"]))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral")
    return directory, alone(directory, make_checkpoint(directory, *VARIANTS["mistral-window3"]))


def watch_claims(engine: LLMEngine) -> list[tuple[bytes, int]]:
    """The (block hash, KV group) the engine's lookups take from its tiers from now on (the
    book's own claims, watched on their way)."""
    book = engine.kv_cache.tiers
    claim, claimed = book.claim, []

    def watched(block_hash: bytes, group: int = 0):
        claimed.append((block_hash, group))
        return claim(block_hash, group)

    book.claim = watched
    return claimed


# With a window of 3 and blocks of 4, a 24-token hit reads each sliding group's last block only.
WINDOW_LOADS = [(HASHES[5], g) for g in (1, 2, 3)]


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_a_hybrid_model_s_blocks_come_back_from_the_host_tier(gemma3, fmt):
    engine = make_engine(gemma3[0], kv_offload_gib=0.01, kv_offload_format=fmt, **GEMMA3)
    claimed = watch_claims(engine)
    tokens, logprobs = through_the_host_tier(engine)
    assert sorted(claimed) == sorted([(h, 0) for h in HASHES[:6]] + WINDOW_LOADS)
    expected, expected_logprobs = gemma3[1]
    assert tokens == expected
    worst = max(abs(a - b) for a, b in zip(logprobs, expected_logprobs, strict=True))
    print(f"{fmt} host tier, Gemma 3: greedy logprobs within {worst:.2e} of the exact run's")
    assert worst < (1e-5 if fmt == "native" else INT8_LOGPROB_BOUND), worst


def file_of(disk, block_hash: bytes, group: int):
    return disk.dir / (tier_key(block_hash, group).hex() + ".kv")


def test_a_hybrid_model_s_disk_tier_serves_a_new_engine_where_every_group_can(
    gemma3, tmp_path, caplog
):
    directory, _ = gemma3
    first = make_engine(directory, kv_cache_dir=str(tmp_path), **GEMMA3)
    generate(first, "first", SHARED)
    disk = first.kv_cache.tiers.disk
    disk.drain()
    assert all(file_of(disk, h, g).exists() for h in HASHES[:6] for g in range(4))
    files = {p.name: p.read_bytes() for p in disk.dir.glob("*.kv")}
    expected, expected_logprobs = gemma3[1]

    second = make_engine(directory, kv_cache_dir=str(tmp_path), **GEMMA3)
    claimed = watch_claims(second)
    tokens, logprobs, cached = generate(second, "restart", FOLLOW_UP)
    assert cached == 24 and second.kv_cache.tiers.hits["disk"] == 6
    assert sorted(claimed) == sorted([(h, 0) for h in HASHES[:6]] + WINDOW_LOADS)
    assert tokens == expected
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)

    # The restarted engine wrote FOLLOW_UP's seventh block: a 28-token hit, whose windows end
    # in that block. One sliding group's file of it gone: the hit ends a block earlier, where
    # every sliding group has its window on disk, never with that group's block missing.
    second.kv_cache.tiers.disk.drain()
    file_of(disk, HASHES[6], 2).unlink()
    third = make_engine(directory, kv_cache_dir=str(tmp_path), **GEMMA3)
    claimed = watch_claims(third)
    tokens, _, cached = generate(third, "shorter", FOLLOW_UP)
    assert cached == 24 and tokens == expected
    assert sorted(claimed) == sorted([(h, 0) for h in HASHES[:6]] + WINDOW_LOADS)

    # Another group layout of the same model files: its own fingerprint, a cold start said
    # once, and the files of this one left as they were.
    config = EngineConfig(
        model=str(directory), dtype="float32", block_size=BLOCK, kv_cache_dir=str(tmp_path)
    )
    other = kv_groups([None, None, 3, 3], 4)
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers.disk_tier"):
        store = KVTierStore.create(config, first.executor.runner.kv_slots, other, directory, None)
    assert store is not None and store.disk.fingerprint != disk.fingerprint
    assert store.disk.num_blocks == 0 and "starting cold" in caplog.text
    store.close()
    kept = {p.name: p.read_bytes() for p in disk.dir.glob("*.kv")}
    assert {name: kept.get(name) for name in files} == files


def test_two_ranks_serve_a_hybrid_model_s_prefix_from_disk(gemma3, tmp_path):
    """TP=2 (the worker rank a real process): both ranks write every group's blocks, and a new
    TP=2 engine serves the prefix from both ranks' files once they agree on every group's."""
    directory, (expected, expected_logprobs) = gemma3
    tp2 = dict(GEMMA3, tensor_parallel_size=2, kv_cache_dir=str(tmp_path))
    first = make_engine(directory, **tp2)
    try:
        generate(first, "first", SHARED)
    finally:
        first.close()  # the ranks write their queued files first
    second = make_engine(directory, **tp2)
    try:
        claimed = watch_claims(second)
        tokens, logprobs, cached = generate(second, "restart", FOLLOW_UP)
    finally:
        second.close()
    assert cached == 24 and tokens == expected
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert sorted(claimed) == sorted([(h, 0) for h in HASHES[:6]] + WINDOW_LOADS)


def test_a_sliding_only_model_loads_its_window_from_each_tier(mistral, tmp_path):
    """Mistral's window on every layer: one sliding group, whose hit reads its last block (the
    restarted engine's hit is a block longer: the first engine cached FOLLOW_UP's seventh)."""
    directory, (expected, expected_logprobs) = mistral
    engine = make_engine(
        directory, kv_offload_gib=0.01, kv_offload_format="native", kv_cache_dir=str(tmp_path)
    )
    claimed = watch_claims(engine)
    generate(engine, "first", SHARED)
    push_out(engine)
    tokens, logprobs, cached = generate(engine, "again", FOLLOW_UP)
    assert cached == 24 and claimed == [(HASHES[5], 0)] and engine.kv_cache.tiers.hits["host"] == 1
    assert tokens == expected
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)
    engine.kv_cache.tiers.disk.drain()
    restarted = make_engine(directory, kv_cache_dir=str(tmp_path))
    claimed = watch_claims(restarted)
    tokens, _, cached = generate(restarted, "restart", FOLLOW_UP)
    assert cached == 28 and claimed == [(HASHES[6], 0)] and tokens == expected


def run(kv: KVCacheManager, tokens: list[int], rid: str = "r") -> None:
    """One request through the manager alone: looked up, allocated, computed, cached, freed."""
    req = Request(rid, tokens, SamplingParams(max_tokens=1))
    blocks, num_cached = kv.get_cached_prefix(req)
    assert kv.allocate(req, len(tokens) - num_cached, blocks)
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req, len(tokens))
    kv.free(req)


def test_a_lookup_takes_from_the_host_tier_only_what_the_hit_reads():
    """Torch-free: a full group and a sliding one (window 5, blocks of 4) over a host tier. A
    prefix pushed out of the pool comes back with the full group's blocks all and the sliding
    group's last two (its window before the hit's end); without the sliding group's last block
    the hit ends where it has its window, a block earlier."""
    book = TierBook(host_blocks=256)  # never full here
    kv = KVCacheManager(16, BLOCK, windows=(None, 5), tiers=book)
    shared = list(range(1, 21))  # five blocks
    hashes = prefix_block_hashes(shared, BLOCK)
    run(kv, [*shared, 99])
    for seed in range(3):
        run(kv, prompt(28, seed), f"flood{seed}")
    assert all(book.holds(h, g) for h in hashes for g in (0, 1))
    req = Request("again", [*shared, 7], SamplingParams(max_tokens=1))
    blocks, num_cached = kv.get_cached_prefix(req)
    # first_seen of the sliding group at 20 tokens: (20 - 5 + 1) // 4 = 4, the last block.
    assert num_cached == 20 and blocks[0::2] == [TIER_BLOCK] * 5
    assert blocks[1::2] == [NULL_BLOCK] * 4 + [TIER_BLOCK]
    assert kv.allocate(req, 1, blocks)
    assert not book.holds(hashes[4], 1) and book.holds(hashes[3], 1)  # claimed, left alone
    loads = book.take_transfers().host_loads
    assert sorted(block for _, block in loads) == sorted(
        b for b in req.block_table[:10] if b != NULL_BLOCK
    )
    kv.free(req)
    # Pushed out again, and the sliding group's block 4 taken out of the host tier (as a load
    # would): the hit is the first four blocks, where the sliding group reads block 3.
    for seed in range(3, 6):
        run(kv, prompt(28, seed), f"flood{seed}")
    book.claim(hashes[4], 1)
    book.take_transfers()
    req = Request("shorter", [*shared, 7], SamplingParams(max_tokens=1))
    blocks, num_cached = kv.get_cached_prefix(req)
    assert num_cached == 16 and blocks[1::2] == [NULL_BLOCK] * 3 + [TIER_BLOCK]
