"""KV cache tiers under tensor parallelism: TP=2 (a worker rank as a real subprocess over gloo)
on test_kv_tiers' tiny random-weight float32 Llama, whose 2 KV heads give each rank one. Blocks
evicted from the pool come back from every rank's host tier exact (native) or within the int8
format's bound; a new TP=2 engine on the same directory finds every rank's shard files, after
its predecessor closed or was killed with SIGKILL; a block whose file one rank lacks is computed
on every rank (and written again); a one-rank engine on that directory reads none of the TP=2
files; the tier messages rank 0 sends survive their int64 encoding; a worker rank's disk bound
deletes rank 0's pinned blocks' files last."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_engine import BLOCK, prompt
from test_kv_tiers import (
    FOLLOW_UP,
    INT8_LOGPROB_BOUND,
    Clock,
    generate,
    make_engine,
    push_out,
    through_the_host_tier,
    write_then_sigkill,
)

from common.block_hash import prefix_block_hashes
from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import KVCacheManager, kv_groups
from engine.core.request import Request
from engine.engine import LLMEngine
from engine.kv_tiers import ranks
from engine.kv_tiers.book import TierTransfers, tier_key
from engine.kv_tiers.store import GIB, KVTierStore
from tiny_models import VARIANTS, make_checkpoint

HASHES = prefix_block_hashes(FOLLOW_UP, BLOCK)  # SHARED's six blocks, then one more


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint(directory, *VARIANTS["llama"])
    return directory


@pytest.fixture(scope="module")
def expected(llama):
    """FOLLOW_UP's greedy tokens and logprobs on one rank without tiers."""
    tokens, logprobs, _ = generate(make_engine(llama, num_kv_blocks=64), "alone", FOLLOW_UP)
    return tokens, logprobs


def tp2(llama, **tiers) -> LLMEngine:
    return make_engine(llama, tensor_parallel_size=2, **tiers)


def shard_files(kv_dir, rank: int) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in kv_dir.glob(f"*/rank{rank}/*.kv")}


@pytest.fixture(scope="module")
def kv_dir(llama, expected, tmp_path_factory):
    """A TP=2 engine with both tiers: SHARED computed, pushed out of the pool to the host tier
    and loaded back from it; its directory once it closed."""
    kv_dir = tmp_path_factory.mktemp("kv")
    engine = tp2(llama, kv_offload_gib=0.01, kv_offload_format="native", kv_cache_dir=str(kv_dir))
    try:
        tokens, logprobs = through_the_host_tier(engine)
    finally:
        engine.close()  # the ranks write their queued files first
    assert tokens == expected[0]
    assert logprobs == pytest.approx(expected[1], abs=1e-4)
    return kv_dir


def test_every_rank_writes_its_shard_of_every_block(kv_dir):
    files = [shard_files(kv_dir, rank) for rank in (0, 1)]
    assert set(files[0]) == set(files[1])
    assert {h.hex() + ".kv" for h in HASHES[:6]} <= set(files[0])
    name = HASHES[0].hex() + ".kv"
    assert files[0][name] != files[1][name]  # each rank's own KV head


def test_a_new_tp2_engine_finds_the_disk_tier_and_a_missing_shard_is_computed(
    llama, kv_dir, expected
):
    # Rank 1 lacks block 3: every rank computes from it on, and it is written again.
    (missing,) = kv_dir.glob(f"*/rank1/{HASHES[3].hex()}.kv")
    missing.unlink()
    engine = tp2(llama, kv_cache_dir=str(kv_dir))
    try:
        tokens, logprobs, cached = generate(engine, "restart", FOLLOW_UP)
        assert cached == 12 and engine.kv_cache.tiers.hits["disk"] == 3
        assert tokens == expected[0]
        assert logprobs == pytest.approx(expected[1], abs=1e-4)
        push_out(engine)  # (their prompts from disk too: the first engine computed them)
        before = engine.kv_cache.tiers.hits["disk"]
        # All seven of its blocks now: block 3 again, and its last, computed in the last run.
        tokens, _, cached = generate(engine, "healed", FOLLOW_UP)
        assert cached == 28 and engine.kv_cache.tiers.hits["disk"] == before + 7
        assert tokens == expected[0]
    finally:
        engine.close()
    assert missing.exists()


def test_a_one_rank_engine_reads_none_of_the_tp2_files(llama, kv_dir, expected, caplog):
    before = [shard_files(kv_dir, rank) for rank in (0, 1)]
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers.disk_tier"):
        engine = make_engine(llama, kv_cache_dir=str(kv_dir))
    assert any("starting cold" in r.getMessage() for r in caplog.records)
    tokens, _, cached = generate(engine, "one rank", FOLLOW_UP)
    assert cached == 0 and tokens == expected[0]
    engine.close()
    assert [shard_files(kv_dir, rank) for rank in (0, 1)] == before


# The engine process of the kill -9 test: computes the prompt, waits until both ranks wrote its
# files, hangs.
def test_a_tp2_engine_killed_with_sigkill_leaves_a_disk_tier_the_next_one_serves(llama, tmp_path):
    system = prompt(200, 7)  # 50 blocks of 4
    config = dict(
        model=str(llama),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=64,
        max_num_batched_tokens=256,
        enforce_eager=True,
        tensor_parallel_size=2,
        kv_cache_dir=str(tmp_path / "kv"),
    )
    write_then_sigkill(config, system)
    question = system + prompt(5, 8)
    engine = LLMEngine(EngineConfig(**config))
    try:
        tokens, _, cached = generate(engine, "after", question)
        assert cached == 200 and engine.kv_cache.tiers.hits["disk"] == 50
    finally:
        engine.close()
    plain = LLMEngine(EngineConfig(**dict(config, kv_cache_dir=None, tensor_parallel_size=1)))
    assert tokens == generate(plain, "cold", question)[0]


def test_each_rank_quantizes_its_own_shard_in_the_int8_host_tier(llama, expected):
    engine = tp2(llama, kv_offload_gib=0.01, kv_offload_format="int8")
    try:
        tokens, logprobs = through_the_host_tier(engine)
    finally:
        engine.close()
    assert tokens == expected[0]
    worst = max(abs(a - b) for a, b in zip(logprobs, expected[1], strict=True))
    print(f"int8 host tier, TP=2: greedy logprobs within {worst:.4f} of the exact run's")
    assert worst < INT8_LOGPROB_BOUND, worst


def test_tier_messages_survive_their_encoding():
    # Blocks of KV groups 0 and 3 (a sliding-window model's), and the pinned hashes.
    sliding = tier_key(HASHES[2], 3)
    moves = ranks.TierMoves(
        persists=[(3, HASHES[0]), (9, tier_key(HASHES[1], 3))],
        transfers=TierTransfers(
            saves=[(1, 0), (2, 5)],
            host_loads=[(4, 7)],
            disk_loads=[(sliding, 11)],
            payloads={sliding: b"never sent"},
        ),
        pinned=HASHES[4:6],
    )
    message = ranks.encode_moves(moves)
    assert message.dtype == np.int64 and b"never sent" not in message.tobytes()
    decoded = ranks.decode(message)
    assert isinstance(decoded, ranks.TierMoves)
    assert decoded.persists == moves.persists
    assert decoded.transfers.saves == moves.transfers.saves
    assert decoded.transfers.host_loads == moves.transfers.host_loads
    assert decoded.transfers.disk_loads == moves.transfers.disk_loads
    assert decoded.transfers.payloads == {}
    assert decoded.pinned == HASHES[4:6]
    # Pins unchanged (None) and no pins left ([]) are told apart.
    for pinned in (None, []):
        unchanged = ranks.decode(ranks.encode_moves(ranks.TierMoves(pinned=pinned)))
        assert isinstance(unchanged, ranks.TierMoves) and unchanged.pinned == pinned
    keys = [HASHES[0], sliding, tier_key(HASHES[1], 1)]
    assert ranks.decode(ranks.encode_probe(keys)) == keys
    with pytest.raises(ValueError, match="must be 32 bytes, got 3"):
        ranks.encode_probe([b"abc"])
    with pytest.raises(ValueError, match="its counts say"):
        ranks.decode(message[:-1])


def test_a_worker_rank_s_disk_bound_deletes_rank_0_s_pinned_files_last(llama, tmp_path):
    """Rank 0's store and a worker rank's, in one process, linked as the TIERS broadcast links
    them (the message encoded and decoded on its way): a pinned prompt's blocks, the oldest
    files, outlive a flood past the disk bound on the worker rank as on rank 0 until the pin
    ends; then they are the oldest, and go first."""
    config = EngineConfig(
        model=str(llama),
        dtype="float32",
        block_size=BLOCK,
        tensor_parallel_size=2,
        kv_cache_dir=str(tmp_path),
        kv_cache_dir_gib=14 * 2 * 256 / GIB,  # 14 blocks' payloads: 12 files with headers
    )
    groups = kv_groups([], 1)
    # One layer of one KV head (of 8 dimensions) per rank: 256 bytes a block.
    stores = [
        KVTierStore.create(config, [torch.randn(2, 64, BLOCK, 1, 8)], groups, llama, None, rank)
        for rank in (0, 1)
    ]
    rank0, worker = stores
    rank0.link_ranks(lambda message: worker.receive(message, lambda flags: flags), lambda f: f)
    kv = KVCacheManager(64, BLOCK, tiers=rank0.book)
    clock = kv.pins.clock = Clock()

    def run(rid: str, tokens: list[int], **pin) -> list[bytes]:
        req = Request(rid, tokens, SamplingParams(max_tokens=1), **pin)
        assert kv.allocate(req, len(tokens))
        kv.cache_blocks(req, len(tokens))
        kv.free(req)
        rank0.book.flush()
        for store in stores:
            store.disk.drain()
        return req.block_hashes

    def files(rank: int) -> set[str]:
        return {p.name for p in stores[rank].disk.dir.glob("*.kv")}

    pinned = {h.hex() + ".kv" for h in run("pinned", prompt(16, 1), pin_ttl_seconds=600)}
    for seed in range(2, 6):
        run(f"flood{seed}", prompt(16, seed))
    assert files(0) == files(1) and pinned <= files(1) and len(files(1)) < 20
    clock.now = 601.0  # the pin ends: its blocks' files are the oldest
    run("flood6", prompt(16, 6))
    assert files(0) == files(1) and not pinned & files(1)
    for store in stores:
        store.close()
