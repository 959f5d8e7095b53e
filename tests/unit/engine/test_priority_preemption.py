"""The priority scheduling policy (lower `priority` runs first): a waiting request that does
not fit, for KV blocks or for sequence slots, preempts running requests strictly less urgent
than itself; FCFS and equal priorities never do. On a tiny float32 model, a late high-priority
request finishes before earlier low-priority ones, which still produce the tokens of clean
runs."""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.engine import LLMEngine
from tiny_models import VARIANTS, make_checkpoint

BLOCK = 4


def scheduler(policy: str, num_blocks: int, max_num_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return Scheduler(
        EngineConfig(block_size=BLOCK, scheduling_policy=policy, max_num_seqs=max_num_seqs), kv
    )


def request(rid: str, prompt_len: int, priority: int) -> Request:
    return Request(
        rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=50), priority=priority
    )


def advance(sched: Scheduler, out) -> None:
    """What the engine does after the forward."""
    for r, n in zip(out.requests, out.num_new_tokens, strict=False):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(7)


@pytest.mark.parametrize("short_of", ["blocks", "slots"])
def test_waiting_request_preempts_only_strictly_less_urgent_running_ones(short_of):
    # Two 6-token prompts take all 4 blocks (and have room for two decodes), or the 2 slots.
    num_blocks, max_num_seqs = (4, 8) if short_of == "blocks" else (64, 2)
    sched = scheduler("priority", num_blocks, max_num_seqs)
    low, later_low = request("low", 6, 5), request("later-low", 6, 5)
    sched.add_request(low)
    sched.add_request(later_low)
    advance(sched, sched.schedule())

    same = request("same", 4, 5)
    sched.add_request(same)
    out = sched.schedule()
    assert same not in out.requests and out.preempted == []  # equal priority: it waits
    advance(sched, out)
    high = request("high", 4, 0)
    sched.add_request(high)
    out = sched.schedule()
    # The least urgent, latest arrival goes; the earlier low keeps running beside the new one.
    assert later_low.status is RequestStatus.PREEMPTED and later_low in out.preempted
    assert high in out.requests and low.status is RequestStatus.RUNNING
    assert same.status is RequestStatus.WAITING


def test_fcfs_never_preempts_for_a_waiting_request():
    sched = scheduler("fcfs", 4)
    running = [request("a", 6, 5), request("b", 6, 5)]
    for r in running:
        sched.add_request(r)
    advance(sched, sched.schedule())
    sched.add_request(request("urgent", 4, -100))
    out = sched.schedule()
    assert out.preempted == [] and set(out.requests) == set(running)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint(directory, *VARIANTS["llama"])
    return directory


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
LOWS = {f"low{i}": prompt(30, i) for i in range(3)}  # 8 blocks each
HIGH = prompt(20, 9)  # 5 blocks


def make_engine(directory, **overrides) -> LLMEngine:
    args = dict(
        model=str(directory),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=64,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    args.update(overrides)
    return LLMEngine(EngineConfig(**args))


def clean_run(directory, tokens: list[int], max_tokens: int) -> list[int]:
    engine = make_engine(directory)
    engine.add_request(
        "clean", tokens, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    )
    got = []
    while engine.has_unfinished:
        for out in engine.step():
            got += out.new_token_ids
    return got


@pytest.mark.parametrize("short_of", ["blocks", "slots"])
def test_late_high_priority_request_finishes_before_earlier_low_ones(model_dir, short_of):
    # blocks: 20 blocks hold the two running lows (8 blocks each, growing to 10) and leave too
    # few for the high one's 5, so only preempting a low lets it in before they finish.
    # slots: memory is plenty but max_num_seqs = 2 is taken by two lows.
    overrides = (
        dict(num_kv_blocks=20, max_num_seqs=4) if short_of == "blocks" else dict(max_num_seqs=2)
    )
    engine = make_engine(model_dir, scheduling_policy="priority", **overrides)
    low_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)
    for rid, tokens in LOWS.items():
        engine.add_request(rid, tokens, low_params, priority=10)
    tokens: dict[str, list[int]] = {}
    finished_at: dict[str, int] = {}

    def step(number: int) -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished_at[out.request_id] = number

    step(0)
    step(1)  # low0 and low1 run and decode; low2 waits
    assert [r.request_id for r in engine.scheduler.running] == ["low0", "low1"]
    engine.add_request(
        "high", HIGH, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), priority=0
    )
    number = 2
    while engine.has_unfinished:
        step(number)
        number += 1

    assert engine.scheduler.num_preemptions >= 1
    assert all(finished_at["high"] < finished_at[rid] for rid in LOWS), finished_at
    assert tokens["high"] == clean_run(model_dir, HIGH, 4)
    for rid, prompt_ids in LOWS.items():
        assert tokens[rid] == clean_run(model_dir, prompt_ids, 10), rid
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
