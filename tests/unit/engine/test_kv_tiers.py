"""KV cache tiers on tiny random-weight models: blocks evicted from the pool come back from the
host tier (exact in the native format, within a stated logprob bound in int8), from the disk tier
in a new engine and after `kill -9` of an engine process; eviction order across the tiers;
corrupt, truncated and foreign files skipped; two engines on one directory; the disk bound; bad
start-up input named by its flag."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_engine import BLOCK, prompt
from test_engine import make_engine as engine_on

from common.block_hash import prefix_block_hashes
from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_events import KVEventPublisher
from engine.core.request import Request
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.kv_tiers import store as kv_tier_store
from engine.kv_tiers.book import TierBook
from engine.kv_tiers.disk_tier import DiskTier
from engine.kv_tiers.host_tier import HostTier, dequantize, quantize
from engine.kv_tiers.pins import PinBook
from engine.kv_tiers.store import SaveThread
from polling import wait_until
from tiny_models import VARIANTS, hf_greedy, make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
# The int8 host tier's bound on the tiny model: |logprob difference| of the greedy tokens.
INT8_LOGPROB_BOUND = 0.1


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    return directory, make_checkpoint(directory, *VARIANTS["llama"])


def make_engine(directory, **overrides) -> LLMEngine:
    """test_engine's engine with a 16-block pool, one step per prompt, no compilation."""
    args = dict(num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4, enforce_eager=True)
    return engine_on(directory, **(args | overrides))


def generate(engine: LLMEngine, rid: str, ids: list[int]) -> tuple[list[int], list[float], int]:
    """Run one request alone: its tokens, their logprobs and its cached prompt tokens."""
    engine.add_request(rid, ids, GREEDY)
    tokens: list[int] = []
    logprobs: list[float] = []
    cached = 0
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp for lp, _ in out.new_logprobs]
            cached = out.num_cached_tokens
    return tokens, logprobs, cached


SHARED = prompt(24, 1)  # six blocks
FOLLOW_UP = SHARED + prompt(6, 2)


def push_out(engine: LLMEngine) -> None:
    """Fill the 16-block pool with other prompts: SHARED's blocks leave it."""
    for seed in (3, 4, 5):
        generate(engine, f"other{seed}", prompt(24, seed))


def through_the_host_tier(engine: LLMEngine) -> tuple[list[int], list[float]]:
    """SHARED computed and pushed out of the pool to the host tier, then FOLLOW_UP served with
    its six blocks loaded back from it: FOLLOW_UP's tokens and logprobs."""
    generate(engine, "first", SHARED)
    push_out(engine)
    book = engine.kv_cache.tiers
    assert book is not None and book.offloaded >= 6 and book.hits["host"] == 0
    tokens, logprobs, cached = generate(engine, "again", FOLLOW_UP)
    assert cached == 24 and book.hits["host"] == 6
    return tokens, logprobs


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_blocks_evicted_to_the_host_tier_come_back(llama, fmt):
    directory, reference = llama
    engine = make_engine(directory, kv_offload_gib=0.01, kv_offload_format=fmt)
    tokens, logprobs = through_the_host_tier(engine)
    stats = engine.stats()
    assert stats.kv_tier_hits == {"host": 24} and 0 < stats.kv_tier_usage["host"] < 1
    plain = make_engine(directory, num_kv_blocks=64)
    expected, expected_logprobs, _ = generate(plain, "alone", FOLLOW_UP)
    assert expected == hf_greedy(reference, FOLLOW_UP, 6)
    if fmt == "native":
        assert tokens == expected
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    else:
        assert tokens == expected
        worst = max(abs(a - b) for a, b in zip(logprobs, expected_logprobs, strict=True))
        print(f"int8 host tier: greedy logprobs within {worst:.4f} of the exact run's")
        assert worst < INT8_LOGPROB_BOUND, worst


@pytest.fixture(scope="module")
def pool_hit(llama):
    """FOLLOW_UP's tokens and logprobs with SHARED's blocks still in the pool: the very
    computation a load from a tier stands in for (the same steps, the KV bytes as they were)."""
    engine = make_engine(llama[0], num_kv_blocks=64)
    generate(engine, "first", SHARED)
    tokens, logprobs, cached = generate(engine, "again", FOLLOW_UP)
    assert cached == 24
    return tokens, logprobs


def hold_saves(engine: LLMEngine) -> tuple[SaveThread, threading.Event]:
    """The engine's save thread, its stores held until the event is set."""
    saves = engine.executor.kv_tiers.saves
    gate, store = threading.Event(), saves.host.store

    def held(slots: torch.Tensor, blocks: torch.Tensor) -> None:
        gate.wait()
        store(slots, blocks)

    saves.host.store = held
    return saves, gate


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_saves_run_off_the_step_and_a_load_racing_one_waits(llama, pool_hit, fmt):
    """With the save thread held in its first save, other prompts overwrite the evicted blocks'
    pool blocks and the saves stay queued; a prompt then loads SHARED's blocks while their saves
    are queued: the load waits for the held save, does the queued ones up to SHARED's on the
    engine's thread and queues the later ones again, and the blocks come back as they were at
    eviction (native: the logprobs of a pool hit, bit for bit; int8: its tokens, logprobs within
    the bound)."""
    directory, _ = llama
    engine = make_engine(directory, kv_offload_gib=0.01, kv_offload_format=fmt)
    saves, gate = hold_saves(engine)
    # The save thread's torch work runs on one thread; the engine's keeps its own.
    threads = torch.get_num_threads()
    assert saves._executor.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == threads
    generate(engine, "before", prompt(24, 9))  # evicted first: the save the thread holds
    generate(engine, "first", SHARED)
    push_out(engine)
    assert saves.pending >= 1 and engine.kv_cache.tiers.offloaded >= 6
    threading.Timer(0.2, gate.set).start()  # released while the load below waits
    tokens, logprobs, cached = generate(engine, "again", FOLLOW_UP)
    assert cached == 24 and saves.waited >= 1
    expected, expected_logprobs = pool_hit
    assert tokens == expected
    if fmt == "native":
        assert logprobs == expected_logprobs
    else:
        worst = max(abs(a - b) for a, b in zip(logprobs, expected_logprobs, strict=True))
        assert worst < INT8_LOGPROB_BOUND, worst


def test_a_failing_save_thread_falls_back_to_saving_on_the_step(llama, pool_hit, caplog):
    """Saves fail on the save thread (injected): one error is logged, the saves it failed are
    redone on the engine's thread and every later one is done there; the blocks come back
    exact."""
    directory, _ = llama
    engine = make_engine(directory, kv_offload_gib=0.01, kv_offload_format="native")
    saves = engine.executor.kv_tiers.saves
    store = saves.host.store

    def fails_off_the_engine_thread(slots: torch.Tensor, blocks: torch.Tensor) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise MemoryError("injected")
        store(slots, blocks)

    saves.host.store = fails_off_the_engine_thread
    with caplog.at_level(logging.ERROR, logger="engine.kv_tiers.store"):
        generate(engine, "first", SHARED)
        push_out(engine)
        # The thread runs at the lowest priority: a load could take every save back before it
        # tried one (and nothing would fail). Done, or failed and redone here, they leave.
        wait_until(lambda: saves.pending == 0, "the save thread's saves", seconds=60)
        tokens, logprobs, cached = generate(engine, "again", FOLLOW_UP)
    failed = [r.getMessage() for r in caplog.records if "save thread failed" in r.getMessage()]
    assert len(failed) == 1 and "MemoryError: injected" in failed[0], failed
    assert cached == 24 and (tokens, logprobs) == pool_hit
    assert saves.pending == 0


def test_saves_stay_within_their_bound_and_the_last_into_a_slot_wins(monkeypatch):
    """With room for one queued save, each save has the ones before it done first (taken back
    from the save thread when it has not started them); saves into the same slots, in any mix
    of the two threads, leave each slot holding its last save."""
    shape = (2, 2, 2, BLOCK, 2, 8)  # [layers, K|V, 2 blocks, block_size, heads, head_dim]
    nbytes = torch.empty(shape).nbytes
    monkeypatch.setattr(kv_tier_store, "MAX_QUEUED_SAVE_BYTES", nbytes)
    host = HostTier(4, (2, 2, BLOCK, 2, 8), torch.float32, "native", pin=False)
    saves = SaveThread(host)
    for i in range(20):
        saves.submit(torch.tensor([i % 3, 3]), torch.full(shape, float(i)))
        assert saves._queued_bytes <= nbytes
    saves.drain()
    assert saves.pending == 0
    held = host.fetch(torch.arange(4))  # [layers, K|V, slot, ...]
    last = [[18.0], [19.0], [17.0], [19.0]]
    assert [held[:, :, slot].unique().tolist() for slot in range(4)] == last


def test_int8_round_trip_error_is_within_half_a_step():
    blocks = (
        torch.randn(3, 2, 2, BLOCK, 2, 8)
        * torch.tensor([1.0, 10.0])[None, None, :, None, None, None]
    )
    runs = blocks.flatten(3)  # one scale per block, layer and K|V
    q, scales = quantize(runs)
    assert q.shape == runs.shape and scales.shape == (3, 2, 2)
    back = dequantize(q, scales, torch.float32)
    step = scales[:, :, :, None].expand_as(runs)
    assert ((back - runs).abs() <= step / 2 + 1e-6).all()


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1))


def test_eviction_goes_pool_then_host_least_recent_first():
    """Torch-free: a 4-block pool over a 2-slot host tier. Blocks leave the pool in LRU order
    (a request's tail first) into the host tier, whose least recently evicted entry drops out
    for a new one; a hit there takes the block back into the pool (leaving the tier)."""
    book = TierBook(host_blocks=2)
    kv = KVCacheManager(4, BLOCK, tiers=book)

    def run(tokens: list[int]) -> None:
        req = Request("r", tokens, SamplingParams(max_tokens=1))
        blocks, num_cached = kv.get_cached_prefix(req)
        assert kv.allocate(req, len(tokens) - num_cached, blocks)
        kv.cache_blocks(req, len(tokens))
        kv.free(req)

    a, b = list(range(1, 9)), list(range(11, 19))
    a0, a1 = prefix_block_hashes(a, BLOCK)
    b0, b1 = prefix_block_hashes(b, BLOCK)
    run([*a, 99])  # a0, a1 cached, the tail block free
    run([*b, 99])  # two free blocks, then a1 (a's tail first) leaves the pool
    assert list(book._host) == [a1]
    assert book.take_transfers().saves == [(1, 0)]  # pool block 1 (a1) into slot 0
    run([21, 22, 23, 24, 99])  # one free block, then a0 leaves
    assert list(book._host) == [a1, a0]
    run([*list(range(31, 39)), 99])  # b1, b0 leave: a1, then a0 drop out of the host tier
    assert list(book._host) == [b1, b0]
    # The KV events say where each block went: medium "GPU" the pool, "CPU" the host tier.
    publisher = KVEventPublisher(16)
    publisher.publish(kv.take_kv_events())
    (snapshot,), _ = publisher.subscribe(0, "another engine's", lambda batch: None)
    held = {(e.medium, h) for e in snapshot.events[1:] for h in e.block_hashes}
    assert {h for medium, h in held if medium == "CPU"} == {b0, b1}
    assert not {a0, a1, b0, b1} & {h for medium, h in held if medium == "GPU"}
    book.take_transfers()
    again = Request("b2", [*b, 7], SamplingParams(max_tokens=1))
    blocks, num_cached = kv.get_cached_prefix(again)
    assert num_cached == 8  # both blocks from the host tier
    assert kv.allocate(again, 1, blocks)
    assert book.hits["host"] == 2 and not book._host
    loads = book.take_transfers().host_loads
    assert sorted(block for _, block in loads) == sorted(again.block_table[:2])


def test_a_bfloat16_pool_under_float32_activations_moves_through_the_tiers(llama, tmp_path):
    """--kv-cache-dtype bfloat16: the host tier keeps the pool's bfloat16 blocks as they are
    (native: the same tokens and logprobs as without the tier), and the disk tier files them
    under a fingerprint of their own, apart from a float32 pool's and from a bfloat16 model's
    (whose K and V are other values)."""
    directory, _ = llama
    narrow = dict(kv_cache_dtype="bfloat16")
    engine = make_engine(directory, kv_offload_gib=0.01, kv_offload_format="native", **narrow)
    assert engine.executor.runner.kv_slots[0].dtype == torch.bfloat16
    tokens, logprobs = through_the_host_tier(engine)
    plain = make_engine(directory, num_kv_blocks=64, **narrow)
    expected, expected_logprobs, _ = generate(plain, "alone", FOLLOW_UP)
    assert tokens == expected and logprobs == expected_logprobs
    fingerprints = {
        make_engine(directory, kv_cache_dir=str(tmp_path), **config).kv_cache.tiers.disk.fingerprint
        for config in (narrow, {}, {"dtype": "bfloat16"})
    }
    assert len(fingerprints) == 3


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_pool_moves_through_the_tiers_as_it_is(llama, tmp_path, kv_cache_dtype):
    """--kv-cache-dtype fp8*: the host tier keeps the pool's one-byte blocks as they are (auto
    picks native there; int8 is refused naming both keys), and the disk tier's files serve a
    new engine: the same tokens and logprobs as without tiers."""
    directory, _ = llama
    narrow = dict(kv_cache_dtype=kv_cache_dtype)
    engine = make_engine(directory, kv_offload_gib=0.01, **narrow)
    assert engine.kv_cache.tiers is not None
    host = engine.executor.kv_tiers.host
    assert host.format == "native" and host.data.dtype == engine.executor.runner.kv_slots[0].dtype
    tokens, logprobs = through_the_host_tier(engine)
    plain = make_engine(directory, num_kv_blocks=64, **narrow)
    expected, expected_logprobs, _ = generate(plain, "alone", FOLLOW_UP)
    assert tokens == expected and logprobs == expected_logprobs
    first = make_engine(directory, kv_cache_dir=str(tmp_path), **narrow)
    generate(first, "first", SHARED)
    first.kv_cache.tiers.disk.drain()
    second = make_engine(directory, kv_cache_dir=str(tmp_path), **narrow)
    tokens, logprobs, cached = generate(second, "again", FOLLOW_UP)
    assert cached == 24 and second.kv_cache.tiers.hits["disk"] == 6
    assert tokens == expected and logprobs == expected_logprobs
    with pytest.raises(ValueError, match=r"kv_offload_format int8 over a float8_\w+ KV pool"):
        make_engine(directory, kv_offload_gib=0.01, kv_offload_format="int8", **narrow)


def test_disk_tier_serves_a_new_engine_and_skips_bad_files(llama, tmp_path, caplog):
    directory, reference = llama
    first = make_engine(directory, kv_cache_dir=str(tmp_path))
    generate(first, "first", SHARED)
    disk = first.kv_cache.tiers.disk
    disk.drain()
    paths = [disk.dir / (h.hex() + ".kv") for h in prefix_block_hashes(FOLLOW_UP, BLOCK)]
    assert all(p.exists() for p in paths[:6])
    # A second engine on the directory while the first still runs: it reads the first's files.
    second = make_engine(directory, kv_cache_dir=str(tmp_path))
    tokens, _, cached = generate(second, "again", FOLLOW_UP)
    assert cached == 24 and tokens == hf_greedy(reference, FOLLOW_UP, 6)
    assert second.kv_cache.tiers.hits["disk"] == 6
    assert second.stats().kv_tier_hits == {"disk": 24}
    good = paths[3].read_bytes()
    damages = {
        "corrupt": good[:-1] + bytes([good[-1] ^ 0xFF]),
        "truncated": good[:-10],
        "foreign": paths[0].read_bytes(),  # another block's file under this block's name
    }
    identity = json.loads((disk.dir / "fingerprint.json").read_text())
    block_hash = prefix_block_hashes(FOLLOW_UP, BLOCK)[3]
    for kind, data in damages.items():
        paths[3].write_bytes(data)
        caplog.clear()
        fresh = DiskTier(str(tmp_path), 10**9, disk.block_bytes, identity)
        with caplog.at_level(logging.WARNING, logger="engine.kv_tiers.disk_tier"):
            assert fresh.read(block_hash) is None and fresh.read(block_hash) is None, kind
        warned = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
        assert len(warned) == 1 and paths[3].name in warned[0], (kind, warned)
    # An engine over the foreign file: served up to it, computed from it on.
    engine = make_engine(directory, kv_cache_dir=str(tmp_path))
    tokens, _, cached = generate(engine, "bad", FOLLOW_UP)
    assert cached == 12 and tokens == hf_greedy(reference, FOLLOW_UP, 6)


# The engine process of the restart test: computes the prompt, waits for its files, hangs.
# An engine process that computes a prompt, waits until every rank has written its files of it,
# says "ready" and waits to be killed.
RESTART_CHILD = """
import json, sys, time
from pathlib import Path
from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine

config = json.loads(sys.argv[1])
engine = LLMEngine(EngineConfig(**config))
engine.add_request("system", json.loads(sys.argv[2]), SamplingParams(max_tokens=1))
while engine.has_unfinished:
    engine.step()
engine.kv_cache.tiers.disk.drain()
kv = Path(config["kv_cache_dir"])
while len({len(list(rank.glob("*.kv"))) for rank in kv.glob("*/rank*")}) > 1:
    time.sleep(0.05)  # the other ranks' files (tensor parallelism) still being written
print("ready", flush=True)
time.sleep(600)
"""


def write_then_sigkill(config: dict, system: list[int]) -> None:
    """An engine process of `config` (its kv_cache_dir) writes `system`'s blocks to the disk
    tier and is killed with SIGKILL (its worker ranks get SIGTERM as their parent dies)."""
    child = subprocess.Popen(
        [sys.executable, "-c", RESTART_CHILD, json.dumps(config), json.dumps(system)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[3],
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    finally:
        child.kill()
        child.wait(60)
    assert child.returncode == -signal.SIGKILL


def test_a_long_system_prompt_is_a_hit_after_kill_9_and_restart(tmp_path):
    """An engine process computes a 2,000-token system prompt and is killed with SIGKILL; a new
    engine on the same directory serves the prompt from the disk tier."""
    model = tmp_path / "model"
    make_checkpoint(
        model, VARIANTS["llama"][0], dict(VARIANTS["llama"][1], max_position_embeddings=4096)
    )
    system = prompt(2000, 7)
    config = dict(
        model=str(model),
        dtype="float32",
        block_size=16,
        num_kv_blocks=160,
        max_num_batched_tokens=2048,
        enforce_eager=True,
        kv_cache_dir=str(tmp_path / "kv"),
    )
    write_then_sigkill(config, system)
    engine = LLMEngine(EngineConfig(**config))
    question = system + prompt(5, 8)
    tokens, _, cached = generate(engine, "after", question)
    assert cached == 2000 and engine.kv_cache.tiers.hits["disk"] == 125
    plain = LLMEngine(EngineConfig(**dict(config, kv_cache_dir=None)))
    assert tokens == generate(plain, "cold", question)[0]


IDENTITY = {"model": "a", "dtype": "float32"}


def test_disk_bound_deletes_the_oldest_files_first(tmp_path):
    disk = DiskTier(str(tmp_path), 10**9, 64, IDENTITY)
    hashes = [bytes([i]) * 32 for i in range(4)]

    def write(i: int, mtime: float) -> None:
        disk.write(hashes[i], bytes([i]) * 64)
        disk.drain()
        os.utime(disk.dir / (hashes[i].hex() + ".kv"), (mtime, mtime))

    file_size = None
    for i in range(3):
        write(i, 1000 + i)
        file_size = (disk.dir / (hashes[i].hex() + ".kv")).stat().st_size
    assert disk.read(hashes[0]) == bytes(64)  # a hit: now the newest
    disk.max_bytes = 3 * file_size
    write(3, 2000)
    left = sorted(p.name for p in disk.dir.glob("*.kv"))
    assert left == sorted(h.hex() + ".kv" for h in (hashes[0], hashes[2], hashes[3]))
    # A pinned block's file goes last: the oldest, hashes[2], stays; the next oldest goes.
    disk.pinned = lambda block_hash: block_hash == hashes[2]
    os.utime(disk.dir / (hashes[2].hex() + ".kv"), (1, 1))
    write(1, 3000)
    left = sorted(p.name for p in disk.dir.glob("*.kv"))
    assert left == sorted(h.hex() + ".kv" for h in (hashes[0], hashes[1], hashes[2]))


def test_start_up_refuses_bad_input_naming_the_flag(llama, tmp_path, caplog):
    directory, _ = llama
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ValueError, match=r"^--kv-cache-dir '.*file' is not a writable directory"):
        DiskTier(str(not_a_dir), 10**9, 64, IDENTITY)
    with pytest.raises(ValueError, match=r"^--kv-cache-dir-gib .* is below one KV block"):
        DiskTier(str(tmp_path / "kv"), 63, 64, IDENTITY)
    with pytest.raises(ValueError, match=r"^--kv-offload-gib 1e-09 is below one KV block"):
        make_engine(directory, kv_offload_gib=1e-9)
    # Another fingerprint's files: a cold start, said once, and their files left as they were.
    old = DiskTier(str(tmp_path / "kv"), 10**9, 64, IDENTITY)
    old.write(bytes(32), bytes(64))
    old.drain()
    (old_file,) = old.dir.glob("*.kv")
    before = old_file.read_bytes()
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers.disk_tier"):
        new = DiskTier(str(tmp_path / "kv"), 10**9, 64, dict(IDENTITY, dtype="bfloat16"))
    (warning,) = [r.getMessage() for r in caplog.records if r.name.endswith("disk_tier")]
    assert warning.startswith("--kv-cache-dir ") and "starting cold" in warning
    assert new.num_blocks == 0 and new.read(bytes(32)) is None
    assert old_file.read_bytes() == before


class Clock:
    """The pins' clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_pinned_prefix_outlives_a_flood_until_its_ttl_ends(llama):
    directory, _ = llama
    engine = make_engine(directory)
    clock = engine.kv_cache.pins.clock = Clock()
    engine.add_request("pinned", SHARED, GREEDY, pin_ttl_seconds=600)
    while engine.has_unfinished:
        engine.step()
    generate(engine, "plain", prompt(24, 9))
    push_out(engine)
    assert generate(engine, "pinned again", FOLLOW_UP)[2] == 24
    # The control: the unpinned prompt's blocks were evicted by the same flood.
    assert generate(engine, "plain again", prompt(24, 9) + prompt(6, 2))[2] == 0
    clock.now = 601.0
    push_out(engine)
    assert generate(engine, "after the ttl", FOLLOW_UP)[2] == 0


def test_with_a_host_tier_a_pinned_prefix_stays_in_the_pool(llama):
    directory, _ = llama
    engine = make_engine(directory, kv_offload_gib=0.01, kv_offload_format="native")
    engine.add_request("pinned", SHARED, GREEDY, pin_ttl_seconds=600)
    while engine.has_unfinished:
        engine.step()
    push_out(engine)
    book = engine.kv_cache.tiers
    assert book is not None and book.offloaded > 0
    assert generate(engine, "pinned again", FOLLOW_UP)[2] == 24
    assert book.hits["host"] == 0  # a pool hit: the pinned blocks never went down


def test_pins_are_bounded_by_a_share_of_the_pool(llama, caplog):
    directory, _ = llama
    engine = make_engine(directory)  # 16 blocks: pins hold at most 8
    long_prompt = prompt(40, 7)  # ten blocks
    with caplog.at_level(logging.WARNING):
        generate(engine, "unpinned", long_prompt)
        engine.add_request("clipped", [*long_prompt, 3], GREEDY, pin_ttl_seconds=60)
        while engine.has_unfinished:
            engine.step()
    assert engine.kv_cache.pins.num_pinned == 8
    assert "pinned 8 of its 10 prompt blocks" in caplog.text
    push_out(engine)
    assert generate(engine, "again", long_prompt)[2] == 32
    # 14 blocks, more than the 8 the pins leave: they give way, the request is not starved.
    engine.add_request("long", prompt(48, 8), GREEDY)
    for _ in range(100):
        if not engine.has_unfinished:
            break
        engine.step()
    assert not engine.has_unfinished and engine.kv_cache.pins.num_pinned < 8
    assert "lose their pins" in caplog.text
    with pytest.raises(InvalidRequestError, match="pin_ttl_seconds"):
        engine.add_request("bad", SHARED, GREEDY, pin_ttl_seconds=-1)


def run_pinned(engine: LLMEngine, rid: str, ids: list[int], **pin) -> None:
    engine.add_request(rid, ids, GREEDY, pin_ttl_seconds=600, **pin)
    while engine.has_unfinished:
        engine.step()


def test_pins_are_bounded_per_owner_counting_each_block_once_until_the_ttl(llama, caplog):
    directory, _ = llama
    engine = make_engine(directory)  # pins may hold 8 blocks in all
    clock = engine.kv_cache.pins.clock = Clock()
    # float32 K and V of 2 layers, 2 KV heads of 16 dimensions, 4 tokens a block.
    assert engine.executor.kv_block_bytes == 2 * 2 * 2 * 16 * BLOCK * 4
    four = 4 * engine.executor.kv_block_bytes + 100  # bytes: the bound is 4 whole blocks
    pins = engine.kv_cache.pins
    with caplog.at_level(logging.WARNING):
        run_pinned(engine, "a", SHARED, pin_owner="key-a", pin_owner_max_bytes=four)
        run_pinned(engine, "b", prompt(16, 12), pin_owner="key-b", pin_owner_max_bytes=four)
    assert (pins.owned("key-a"), pins.owned("key-b")) == (4, 4)
    assert "pinned 4 of its 6 prompt blocks" in caplog.text
    assert "--max-pinned-gib-per-key" in caplog.text and "'key-a'" in caplog.text
    assert "request b:" not in caplog.text  # key-b within its bound: no warning
    push_out(engine)
    # key-a's leading 4 blocks outlive the flood, its last 2 not; key-b's whole prompt does.
    assert generate(engine, "a again", FOLLOW_UP)[2] == 16
    assert generate(engine, "b again", [*prompt(16, 12), 5])[2] == 16
    # Pinning the same prefix again refreshes its TTL and adds nothing.
    clock.now = 500.0
    run_pinned(engine, "a twice", SHARED, pin_owner="key-a", pin_owner_max_bytes=four)
    assert pins.owned("key-a") == 4 and engine.stats().kv_pinned_blocks == 8
    # Past the first TTL, before the refreshed one: key-a's pins last, key-b's ended.
    clock.now = 700.0
    assert engine.stats().kv_pinned_blocks == 4  # the stats take the ended pins first
    assert (pins.owned("key-a"), pins.owned("key-b")) == (4, 0)
    # key-b's budget is free again: a new 4-block prompt of its is pinned whole.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run_pinned(engine, "b new", prompt(16, 14), pin_owner="key-b", pin_owner_max_bytes=four)
    assert pins.owned("key-b") == 4 and "pinned" not in caplog.text


def test_the_host_tier_drops_pinned_blocks_last():
    """Torch-free: a 2-slot host tier makes room with its least recently evicted unpinned block;
    an unpinned block finding only pinned ones is not kept; a pinned one then takes the oldest."""
    book = TierBook(host_blocks=2)
    pins = PinBook(8)
    book.track_pins(pins)
    pins.pin(b"h1", 600)
    for block, block_hash in enumerate((b"h1", b"h2", b"h3", b"h4")):
        book.evicted(block, block_hash)
    assert [book.holds(h) for h in (b"h1", b"h2", b"h3", b"h4")] == [True, False, False, True]
    pins.unpin(b"h1")  # its pin ended: the next to go
    book.evicted(5, b"h5")
    assert not book.holds(b"h1") and book.holds(b"h4") and book.holds(b"h5")
    pins.pin(b"h4", 600)
    pins.pin(b"h5", 600)
    book.evicted(6, b"h6")
    assert not book.holds(b"h6")
    pins.pin(b"h7", 600)
    book.evicted(7, b"h7")
    assert [book.holds(h) for h in (b"h4", b"h5", b"h7")] == [False, True, True]


def test_pins_giving_way_move_down_to_the_host_tier_and_stay_there(llama, caplog):
    """Pins that give way to a long request leave the pool for the host tier, still pinned; a
    flood that cycles the host tier more than its size over drops unpinned blocks, not them."""
    directory, _ = llama
    host_slots = 8
    engine = make_engine(
        directory,
        kv_offload_gib=host_slots * 2 * 2 * 2 * 16 * BLOCK * 4 / 1024**3,
        kv_offload_format="native",
    )
    book = engine.kv_cache.tiers
    assert book is not None and book.host_blocks == host_slots
    run_pinned(engine, "pinned", SHARED)
    pinned_hashes = prefix_block_hashes(SHARED, BLOCK)
    with caplog.at_level(logging.WARNING):
        generate(engine, "long", prompt(48, 8))  # 14 blocks: more than the pins leave
    assert "move down a tier" in caplog.text
    moved = [h for h in pinned_hashes if book.holds(h)]
    assert moved and engine.kv_cache.pins.num_pinned == 6
    offloaded = book.offloaded
    push_out(engine)
    assert book.offloaded - offloaded > host_slots  # every unpinned slot was taken again
    assert all(book.holds(h) for h in moved)
    assert generate(engine, "pinned again", FOLLOW_UP)[2] == 24
    assert book.hits["host"] == len(moved)
