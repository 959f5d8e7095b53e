"""Scheduler behaviour with a real KV cache manager and no model: budgets, chunking,
admission, preemption by policy, the bounded queue."""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.errors import QueueFullError

BLOCK = 4


def make(num_blocks=64, **cfg):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=cfg.pop("prefix", False))
    return Scheduler(EngineConfig(block_size=BLOCK, **cfg), kv), kv


def req(rid, prompt_len, priority=0, arrival=None, base=0):
    r = Request(
        rid,
        [base + i % 50 + 1 for i in range(prompt_len)],
        SamplingParams(max_tokens=100),
        priority=priority,
    )
    if arrival is not None:
        r.times.arrival = arrival
    return r


def advance(sched, out, token=7):
    """What the engine does after the forward: computed tokens move on, completed ones sample."""
    for r, n in zip(out.requests, out.num_new_tokens, strict=False):
        r.num_computed_tokens += n
        sched.kv_cache.cache_blocks(r, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(token)


def check_tables(sched):
    for r in sched.running:
        assert len(r.block_table) * BLOCK >= r.num_computed_tokens


def test_budget_is_shared_running_first_and_prompts_are_chunked():
    sched, _ = make(max_num_batched_tokens=10)
    a, b = req("a", 7), req("b", 12)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_new_tokens == [7, 3]  # b gets what is left of the budget
    advance(sched, out)
    out = sched.schedule()
    # a decodes (1 token, listed first), b continues its prefill with the rest of the budget.
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens, strict=False)] == [
        ("a", 1),
        ("b", 9),
    ]
    assert out.num_decodes == 1
    advance(sched, out)
    assert b.num_computed_tokens == 12 and b.num_output_tokens == 1
    out = sched.schedule()
    assert out.num_new_tokens == [1, 1] and out.num_decodes == 2
    assert out.total_tokens <= 10
    check_tables(sched)


def test_max_num_seqs_caps_running():
    sched, _ = make(max_num_seqs=2)
    for i in range(4):
        sched.add_request(req(f"r{i}", 5))
    out = sched.schedule()
    assert len(out.requests) == 2 and len(sched.waiting) == 2


def test_bounded_queue_refuses_with_clear_error_and_keeps_state():
    sched, _ = make(max_waiting_requests=2)
    sched.add_request(req("a", 3))
    sched.add_request(req("b", 3))
    with pytest.raises(QueueFullError, match="max_waiting_requests"):
        sched.add_request(req("c", 3))
    assert len(sched.waiting) == 2
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b"]


def test_fcfs_preempts_latest_arrival_and_recomputes_it():
    # 4 blocks of 4 tokens: two 8-token prompts fit (2 blocks each) until both need a third block.
    sched, kv = make(num_blocks=4)
    a, b = req("a", 8), req("b", 8)
    sched.add_request(a)
    sched.add_request(b)
    advance(sched, sched.schedule())  # both prefilled: 8 tokens each, tables full
    advance(sched, sched.schedule())  # a needs a third block; b is preempted
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert a.status is RequestStatus.RUNNING and sched.num_preemptions == 1
    assert kv.num_free_blocks == 4 - len(a.block_table)
    sched.finish(a)
    out = sched.schedule()
    # b is recomputed: its prompt and the token it had already produced.
    assert out.requests == [b] and out.num_new_tokens == [b.num_tokens]


def test_priority_policy_orders_waiting_and_preempts_least_urgent():
    sched, _ = make(num_blocks=4, scheduling_policy="priority", max_num_seqs=2)
    low = req("low", 8, priority=5, arrival=1.0)
    high = req("high", 8, priority=0, arrival=2.0)
    urgent = req("urgent", 3, priority=-1, arrival=3.0)
    sched.add_request(low)
    sched.add_request(high)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["high", "low"]
    advance(sched, out)
    # Both now need a third block; the least urgent (low) is the one preempted.
    out = sched.schedule()
    assert low.status is RequestStatus.PREEMPTED and high in out.requests
    advance(sched, out)
    sched.add_request(urgent)
    assert sched.waiting.peek() is urgent


def test_finish_frees_blocks_of_waiting_and_running():
    sched, kv = make(num_blocks=8)
    a, b = req("a", 9), req("b", 9)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    c = req("c", 3)
    sched.add_request(c)
    sched.finish(c)
    sched.finish(a)
    sched.finish(b)
    assert kv.num_free_blocks == 8 and not sched.has_unfinished


def test_prefix_cache_hit_skips_computed_tokens():
    sched, _kv = make(prefix=True)
    a = req("a", 10)
    sched.add_request(a)
    advance(sched, sched.schedule())
    sched.finish(a)
    b = req("b", 10)  # same tokens
    sched.add_request(b)
    out = sched.schedule()
    # Two full blocks (8 tokens) come from the cache; the rest is computed.
    assert b.num_cached_tokens == 8 and out.num_new_tokens == [2]
