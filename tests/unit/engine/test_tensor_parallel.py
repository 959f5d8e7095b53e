"""Tensor parallelism on tiny float32 models with 4 KV heads: TP=2 and TP=4 (worker ranks as
real subprocesses over gloo on 127.0.0.1) give TP=1's greedy and seeded tokens, and logprobs
(prompt logprobs too) within 1e-4, through chunked prefill, prefix-cache hits, preemption and
n > 1; rank 0's share of the cores ends with its engine; sizes that do not fit the heads are
refused by number; external workers wait for their engine and join it again after it restarts;
a worker killed with SIGKILL fails the engine's next step with an error that names it, within
15 s."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine
from engine.errors import EngineGroupError
from engine.layers.parallel import TensorParallel, check_tensor_parallel_size, kv_heads_slice
from tiny_models import SMALL, make_checkpoint

# 8 query heads over 4 KV heads: TP=2 and TP=4 split the KV heads; TP=8 would replicate them.
FOUR_KV_HEADS = dict(SMALL, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
BLOCK = 16
BUDGET = 16  # tokens per step: every prompt here is prefilled in chunks
SHARED = 40  # tokens of prefix the second wave shares with the first


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp4kv")
    make_checkpoint(directory, LlamaConfig, FOUR_KV_HEADS)
    return directory


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
PROMPT_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
SAMPLED_N2 = SamplingParams(
    temperature=1.0, seed=5, n=2, max_tokens=10, ignore_eos=True, logprobs=1
)
FIRST_WAVE = {f"a{i}": prompt(SHARED + 7 * i, i) for i in range(4)}
# Same first SHARED tokens as a0: whole cached blocks, then a new tail.
SECOND_WAVE = {"b0": FIRST_WAVE["a0"][:SHARED] + prompt(9, 50), "b1": prompt(30, 51)}


def make_engine(model_dir, tp: int, **overrides) -> LLMEngine:
    args = dict(
        model=str(model_dir),
        dtype="float32",
        block_size=BLOCK,
        # Too few blocks for all four first-wave requests at once: some are preempted.
        num_kv_blocks=14,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=6,
        tensor_parallel_size=tp,
    )
    return LLMEngine(EngineConfig(**{**args, **overrides}))


def run(engine: LLMEngine, wave: dict[str, list[int]], params: dict | None = None) -> dict:
    """Every request of the wave to the end (GREEDY unless `params` names others);
    (request id, sample) -> (tokens, logprobs: the outputs' then the prompt's, if asked)."""
    for request_id, tokens in wave.items():
        engine.add_request(request_id, tokens, (params or {}).get(request_id, GREEDY))
    results: dict = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens, logprobs = results.setdefault((out.request_id, out.index), ([], []))
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs)
            logprobs.extend((lp, top) for _, lp, top in out.prompt_logprobs or [])
    return results


def workload(engine: LLMEngine) -> tuple[dict, dict]:
    results = run(engine, FIRST_WAVE, {"a3": SAMPLED_N2})
    results.update(run(engine, SECOND_WAVE, {"b1": PROMPT_LOGPROBS}))
    return results, engine.stats()


@pytest.fixture(scope="module")
def single(model_dir):
    engine = make_engine(model_dir, 1)
    return workload(engine)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_one_rank(model_dir, single, tp):
    expected, expected_stats = single
    threads = torch.get_num_threads()
    engine = make_engine(model_dir, tp)
    try:
        # Rank 0 runs on its share of the cores while the engine lives, and no longer.
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // tp)
        got, stats = workload(engine)
    finally:
        engine.close()
    assert torch.get_num_threads() == threads
    # The workload really went through preemption and prefix-cache hits, on both sides.
    for s in (expected_stats, stats):
        assert s.num_preemptions > 0
        assert s.prefix_cache_hits > 0
    assert ("a3", 1) in got  # the n = 2 request's second sample
    assert len(got[("b1", 0)][1]) == len(SECOND_WAVE["b1"]) - 1  # its prompt logprobs
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in expected.items()}
    for key, (_, logprobs) in got.items():
        for (lp, top), (lp_ref, top_ref) in zip(logprobs, expected[key][1], strict=True):
            assert lp == pytest.approx(lp_ref, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in top_ref]
            assert [v for _, v in top] == pytest.approx([v for _, v in top_ref], abs=1e-4)


def test_speculative_drafts_under_tensor_parallelism_keep_the_greedy_tokens(model_dir):
    """ngram drafts at TP=2 (the plan carries them to the worker, whose KV slots of rejected
    drafts are written over as rank 0's are): the greedy tokens of TP=1 without drafts, with
    drafts accepted and rejected, through chunked prefill and preemption."""
    repeated = {f"r{i}": prompt(12, 60 + i) * 3 for i in range(3)}
    # Long enough for the random model to repeat itself: drafts of its own output accepted.
    params = dict.fromkeys(
        repeated, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    expected = {k: v[0] for k, v in run(make_engine(model_dir, 1), repeated, params).items()}
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    engine = make_engine(model_dir, 2, speculative_config=ngram)
    assert engine.drafter is not None
    engine.drafter.measured = None  # drafts every step, whatever the machine's load
    try:
        got = {k: v[0] for k, v in run(engine, repeated, params).items()}
        stats = engine.stats()
    finally:
        engine.close()
    assert got == expected
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.num_preemptions > 0


def test_sizes_that_do_not_fit_the_heads_are_refused_by_number(model_dir):
    for size in (1, 3, 9):  # SmolLM2-135M: 9 heads, 3 KV heads
        check_tensor_parallel_size(9, 3, size)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 .* 9 attention heads and 3 KV"):
        check_tensor_parallel_size(9, 3, 2)
    with pytest.raises(ValueError, match=r"possible sizes: 1, 2, 4, 8"):
        check_tensor_parallel_size(8, 4, 3)
    # Refused before any worker process starts.
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        make_engine(model_dir, 3)


def test_kv_heads_are_split_or_replicated():
    assert [kv_heads_slice(4, TensorParallel(r, 2)).start for r in range(2)] == [0, 2]
    assert {kv_heads_slice(4, TensorParallel(r, 2)).count for r in range(2)} == {2}
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1 (their q heads').
    replicated = [kv_heads_slice(2, TensorParallel(r, 4)) for r in range(4)]
    assert [(s.start, s.count) for s in replicated] == [(0, 1), (0, 1), (1, 1), (1, 1)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(port: int, log: Path) -> subprocess.Popen:
    with log.open("w") as output:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "folio.cli", "engine-worker", "--rank", "1"),
                *("--world-size", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def start_engine_for_worker(model_dir, port: int) -> LLMEngine:
    """A TP=2 engine on `port` whose rank 1 is an external worker; fails the test when the
    worker has not joined within two minutes (the engine waits for it without end)."""
    engines: list[LLMEngine] = []
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=32,
        tensor_parallel_size=2,
        master_port=port,
        external_workers=True,
    )
    # Daemon: left waiting for the worker only when the test fails.
    starting = threading.Thread(target=lambda: engines.append(LLMEngine(config)), daemon=True)
    starting.start()
    starting.join(120)
    assert engines, "the worker never joined the engine's group"
    return engines[0]


def test_external_worker_waits_for_its_engine_and_rejoins_after_a_restart(
    model_dir, single, tmp_path
):
    """The second engine is the first one "restarted" on the same port. The first lingers a
    while after it stopped the group (as a process does while it exits: its rendezvous store
    still answers), and the worker, back at once for the next engine, must not join the stopped
    one's group (it would wait there for a rank 0 that never comes)."""
    expected, _ = single
    port = free_port()
    log = tmp_path / "worker.log"
    worker = start_worker(port, log)  # before any engine: it retries the rendezvous
    try:
        for _ in range(2):
            engine = start_engine_for_worker(model_dir, port)
            try:
                got = run(engine, {"a1": FIRST_WAVE["a1"]})
            finally:
                engine.close()
            time.sleep(2)  # the stopped engine's store still answers on the port
            # As when its process ends: the rendezvous port goes with the engine's last reference
            # (the model's process group holds the store).
            del engine
            gc.collect()
            assert got[("a1", 0)][0] == expected[("a1", 0)][0]
            assert worker.poll() is None  # it went back to waiting for an engine
    finally:
        worker.terminate()
        worker.wait(30)
    # It served each engine once, and never the stopped one again.
    assert log.read_text().count("rank 1 of 2: serving") == 2, log.read_text()


def test_a_killed_worker_fails_the_engine_with_its_name(model_dir):
    engine = make_engine(model_dir, 2)
    failures: list[EngineGroupError] = []
    engine.add_failure_listener(failures.append)
    try:
        run(engine, {"x": prompt(20, 9)})  # the group works
        (worker,) = engine.executor.group.workers.values()
        os.kill(worker.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        engine.add_request("y", prompt(20, 10), GREEDY)
        # Idle when it died: the watchman notices; a step (if it races ahead) fails too.
        while not failures and time.monotonic() - killed_at < 15:
            time.sleep(0.05)
        assert failures, "the engine did not notice the dead worker within 15 s"
        assert "rank 1" in str(failures[0]) and "SIGKILL" in str(failures[0])
        with pytest.raises(EngineGroupError, match="rank 1"):
            engine.step()
    finally:
        engine.close()
