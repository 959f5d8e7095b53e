"""The scheduler's goodput policies with a real KV cache manager and no model: deadlines
(earliest first within a priority, refusal at admission from the step cost model), weighted fair
shares between tenants, who is preempted first under KV pressure, and the batch lane."""

from __future__ import annotations

import time

import pytest

from common.config import EngineConfig
from common.sampling_params import BATCH_PRIORITY, SamplingParams
from common.service_level import ServiceLevel
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step_cost import LiveStepCost, StepCostModel
from engine.errors import DeadlineUnmeetable, InvalidRequestError

BLOCK = 4
# 10 ms a step, 1 ms a prefill token: a 64-token prompt takes 74 ms on an idle engine.
COST = StepCostModel(fixed_seconds=0.01, prefill_token_seconds=0.001, decode_sequence_seconds=0.0)


def make(num_blocks=256, cost=None, **cfg):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    config = EngineConfig(block_size=BLOCK, **cfg)
    return Scheduler(config, kv, LiveStepCost(cost) if cost else None)


def req(rid, prompt_len, *, priority=0, arrival=0.0, max_tokens=100, **service):
    r = Request(
        rid,
        [i % 50 + 1 for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        service=ServiceLevel(**service),
    )
    r.times.arrival = arrival
    return r


def advance(sched, out, token=7):
    """What the engine does after a step: computed tokens move on, completed ones sample, and
    those at max_tokens end."""
    for r, n in zip(out.requests, out.num_new_tokens, strict=False):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(token)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish(r)


def order(sched):
    popped = []
    while len(sched.waiting):
        popped.append(sched.waiting.pop().request_id)
    return popped


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_earliest_deadline_first_within_a_priority(policy):
    sched = make(scheduling_policy=policy)
    sched.add_request(req("none", 4, arrival=1.0))
    sched.add_request(req("late", 4, arrival=2.0, ttft_ms=900))
    sched.add_request(req("soon", 4, arrival=3.0, ttft_ms=100))
    sched.add_request(req("total", 4, arrival=4.0, total_ms=500))
    sched.add_request(req("none2", 4, arrival=5.0))
    sched.add_request(req("urgent", 4, arrival=6.0, priority=-1))
    # Deadlines are absolute (arrival + ms): soon 3.1, total 4.5, late 2.9 -> late first.
    expected = ["late", "soon", "total", "none", "none2"]
    if policy == "fcfs":
        expected.append("urgent")  # fcfs ignores priority; no deadline: arrival order
    else:
        expected.insert(0, "urgent")
    assert order(sched) == expected


def test_admission_refuses_a_deadline_the_queue_makes_unmeetable():
    sched = make(cost=COST, max_num_batched_tokens=64, scheduling_policy="priority")
    for i in range(8):  # 512 prompt tokens queued, due before the next: 8 steps of 74 ms
        sched.add_request(req(f"q{i}", 64, arrival=float(i), ttft_ms=1000))
    # Alone it would take 74 ms; behind the queue about 0.6 s.
    with pytest.raises(DeadlineUnmeetable, match="slo_ttft_ms leaves 200 ms") as refused:
        sched.add_request(req("hurried", 64, arrival=10.0, ttft_ms=200))
    assert refused.value.retry_after >= 1
    assert len(sched.waiting) == 8  # nothing changed
    sched.add_request(req("patient", 64, arrival=10.0, ttft_ms=2000))
    # An earlier deadline runs ahead of the queue, so only what is ahead of it counts.
    sched.add_request(req("ahead", 64, arrival=11.0, ttft_ms=200, priority=-1))
    assert len(sched.waiting) == 10


def test_a_deadline_below_one_step_is_refused_at_once_with_the_reason():
    sched = make(cost=COST)
    with pytest.raises(InvalidRequestError, match="below one engine step") as refused:
        sched.add_request(req("x", 64, total_ms=20))
    assert refused.value.param == "slo_total_ms"
    assert len(sched.waiting) == 0


def test_requests_without_deadlines_are_never_refused_for_time():
    sched = make(cost=COST, max_num_batched_tokens=64)
    for i in range(50):
        sched.add_request(req(f"q{i}", 64, arrival=float(i)))
    assert len(sched.waiting) == 50


def run_flood(sched, tenants, steps, prompt_len=24, max_tokens=8):
    """Each tenant keeps its waiting queue full; returns the tokens computed per tenant."""
    computed = dict.fromkeys(tenants, 0)
    counter = 0
    for _ in range(steps):
        for tenant, weight in tenants.items():
            while sum(1 for r in sched.waiting if r.tenant == tenant) < 16:
                counter += 1
                sched.add_request(
                    req(
                        f"{tenant}{counter}",
                        prompt_len,
                        arrival=float(counter),
                        max_tokens=max_tokens,
                        tenant=tenant,
                        weight=weight,
                    )
                )
        out = sched.schedule()
        for r, n in zip(out.requests, out.num_new_tokens, strict=False):
            computed[r.tenant] += n
        advance(sched, out)
    return computed


def test_fair_shares_follow_the_weights_over_a_long_run():
    sched = make(scheduling_policy="fair", max_num_seqs=8, max_num_batched_tokens=64)
    computed = run_flood(sched, {"heavy": 1.0, "gold": 3.0}, steps=2000)
    share = computed["gold"] / sum(computed.values())
    assert share == pytest.approx(0.75, rel=0.05), computed


def test_fcfs_serves_whoever_queued_first():
    # The same flood under fcfs: shares follow arrival, not weight (what fair changes).
    sched = make(scheduling_policy="fcfs", max_num_seqs=8, max_num_batched_tokens=64)
    computed = run_flood(sched, {"heavy": 1.0, "gold": 3.0}, steps=2000)
    share = computed["gold"] / sum(computed.values())
    assert share == pytest.approx(0.5, rel=0.05), computed


def test_fair_preempts_the_tenant_most_over_its_share_first():
    # 8 blocks: four 8-token prompts fill them; the next step each needs a third block.
    sched = make(num_blocks=8, scheduling_policy="fair")
    light = req("light", 8, arrival=5.0, tenant="light")  # the latest arrival
    heavy = [req(f"heavy{i}", 8, arrival=1.0 + i, tenant="heavy") for i in range(3)]
    for r in (light, *heavy):
        sched.add_request(r)
    advance(sched, sched.schedule())  # all four prefilled: 24 tokens heavy, 8 light
    out = sched.schedule()
    assert light.status is RequestStatus.RUNNING and light in out.requests
    # fcfs would have preempted the latest arrival, light's.
    assert out.preempted and all(r.tenant == "heavy" for r in out.preempted)


def test_fair_admission_preempts_a_tenant_far_over_its_share():
    sched = make(scheduling_policy="fair", max_num_seqs=4, max_num_batched_tokens=16)
    stream = req("stream", 4, arrival=0.0, tenant="light", max_tokens=1000)
    sched.add_request(stream)
    hogs = [req(f"hog{i}", 16, arrival=1.0 + i, tenant="hog", max_tokens=1000) for i in range(3)]
    for r in hogs:
        sched.add_request(r)
    for _ in range(6):  # the hog holds three of the four slots and is 48 tokens ahead
        advance(sched, sched.schedule())
    second = req("second", 4, arrival=100.0, tenant="light")
    sched.add_request(second)
    out = sched.schedule()
    assert second in out.requests
    assert [r.request_id for r in out.preempted] == ["hog2"]
    # Between tenants level with each other a newcomer waits for a free slot instead.
    sched.add_request(req("third", 4, arrival=101.0, tenant="hog"))
    assert not sched.schedule().preempted


def batch_req(rid, prompt_len, arrival):
    return req(rid, prompt_len, priority=BATCH_PRIORITY, arrival=arrival, max_tokens=1000)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_batch_lane_yields_within_one_step(policy):
    # Batch requests fill the engine: every sequence slot and most of the KV pool.
    sched = make(num_blocks=16, scheduling_policy=policy, max_num_seqs=4)
    batch = [batch_req(f"b{i}", 12, arrival=float(i)) for i in range(6)]
    for r in batch:
        sched.add_request(r)
    advance(sched, sched.schedule())
    assert sum(r.status is RequestStatus.RUNNING for r in batch) == 4
    interactive = req("chat", 12, arrival=10.0)
    sched.add_request(interactive)
    # The very next step runs it (its TTFT grew by at most the step in flight when it came):
    # the latest batch request gave up its slot and blocks.
    out = sched.schedule()
    assert interactive in out.requests
    assert out.num_new_tokens[out.requests.index(interactive)] == 12
    assert [r.request_id for r in out.preempted] == ["b3"]
    # Batch requests waiting are not admitted while an interactive one waits.
    sched.add_request(req("chat2", 12, arrival=11.0))
    waiting_batch = {r.request_id for r in sched.waiting if r.is_batch}
    out = sched.schedule()
    assert not waiting_batch & {r.request_id for r in out.requests}


def test_batch_lane_fills_idle_capacity():
    sched = make(num_blocks=64, max_num_seqs=8)
    sched.add_request(req("chat", 8, arrival=1.0))
    sched.add_request(batch_req("b0", 8, arrival=0.0))  # arrived first, runs second
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["chat", "b0"]


def test_batch_never_preempts_interactive():
    # 4 blocks: an interactive request holds 2, a batch request 2; both need a third.
    sched = make(num_blocks=4)
    chat = req("chat", 8, arrival=2.0)
    bulk = batch_req("bulk", 8, arrival=1.0)
    sched.add_request(chat)
    sched.add_request(bulk)
    advance(sched, sched.schedule())
    out = sched.schedule()
    assert chat.status is RequestStatus.RUNNING and chat in out.requests
    assert bulk.status is RequestStatus.PREEMPTED


def test_engine_ends_a_request_at_its_total_deadline(default_model_dir):
    from common.finish_reason import FinishReason
    from engine.simulated import simulated_engine

    # Steps of 20 ms (really slept): a request of 1000 tokens cannot end within 100 ms.
    cost = StepCostModel(0.02, 0.0, 0.0)
    config = EngineConfig(model=str(default_model_dir), block_size=BLOCK, num_kv_blocks=512)
    engine = simulated_engine(config, cost)
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    engine.add_request("late", [5, 6, 7], params, service=ServiceLevel(total_ms=100))
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    ends = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                ends[output.request_id] = (output.finish_reason, output.num_output_tokens)
    reason, generated = ends["late"]
    assert reason is FinishReason.DEADLINE and 0 < generated < 1000
    assert ends["free"] == (FinishReason.LENGTH, 10)
    assert not engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks


def test_fair_admission_takes_the_request_not_the_victim_put_back_before_it():
    # Tenant a holds both slots; b comes back level with it in virtual time (idle time is not
    # banked) and within its share of slots, so it preempts a's latest request, which, put
    # back, leads the tie of virtual times (put-back requests come first).
    sched = make(scheduling_policy="fair", max_num_seqs=2, max_num_batched_tokens=64)
    a = [req(f"a{i}", 4, arrival=1.0 + i, tenant="a", max_tokens=1000) for i in range(2)]
    for r in a:
        sched.add_request(r)
    advance(sched, sched.schedule())
    b_next = req("b1", 4, arrival=5.0, tenant="b")
    sched.add_request(b_next)
    for _ in range(3):
        advance(sched, sched.schedule())
    assert b_next.status is RequestStatus.RUNNING and b_next not in list(sched.waiting)
    assert len(sched.running) == len(set(sched.running)) <= 2
    assert sum(r.status is RequestStatus.RUNNING for r in a) == 1


def test_fair_a_blocked_tenant_holds_up_no_other():
    # The flood holds every slot and queues more. A tenant coming back starts level with it
    # (idle time is not banked), so the flood's earlier request is the lane's head; it cannot
    # start (its tenant is over its share), and the newcomer, within its share, must not wait
    # behind it for a step: it takes a flood slot in the very next one.
    sched = make(scheduling_policy="fair", max_num_seqs=2, max_num_batched_tokens=64)
    flood = [req(f"f{i}", 4, arrival=float(i), tenant="flood", max_tokens=1000) for i in range(4)]
    for r in flood:
        sched.add_request(r)
    advance(sched, sched.schedule())
    light = req("light", 4, arrival=10.0, tenant="light")
    sched.add_request(light)
    assert sched.waiting.peek() is flood[2]  # level in virtual time, the flood's came first
    out = sched.schedule()
    assert light in out.requests
    assert [r.request_id for r in out.preempted] == ["f1"]


def test_fair_admission_counts_on_preempting_for_a_tenant_within_its_share():
    # The flood holds both slots for a thousand steps and queues more. A light request may
    # take a flood slot at its turn, so its deadline is met by the prefill ahead of it alone:
    # admitted (not refused for the slots the flood would free ten seconds later), and started.
    sched = make(cost=COST, scheduling_policy="fair", max_num_seqs=2, max_num_batched_tokens=64)
    flood = [req(f"f{i}", 4, arrival=float(i), tenant="flood", max_tokens=1000) for i in range(6)]
    for r in flood:
        sched.add_request(r)
    advance(sched, sched.schedule())
    light = req("light", 4, arrival=10.0, tenant="light", ttft_ms=200)
    sched.add_request(light)
    assert light in sched.schedule().requests
    # A flood request with the same deadline waits for a slot to free: refused.
    with pytest.raises(DeadlineUnmeetable):
        sched.add_request(req("f-late", 4, arrival=11.0, tenant="flood", ttft_ms=200))


def test_fair_never_preempts_for_a_tenant_ahead_in_tokens():
    # A burst of the light tenant holds three of four slots, over its share of two, but it is
    # far behind in tokens served: the heavy tenant's next request, within its share of slots,
    # waits for a free one instead of having a light request recomputed for it.
    sched = make(scheduling_policy="fair", max_num_seqs=4, max_num_batched_tokens=128)
    sched.add_request(req("h0", 100, arrival=0.0, tenant="heavy", max_tokens=1000))
    for i in range(3):
        sched.add_request(req(f"l{i}", 4, arrival=1.0 + i, tenant="light", max_tokens=1000))
    advance(sched, sched.schedule())  # all four run: 100 tokens for heavy, 12 for light
    h1 = req("h1", 4, arrival=10.0, tenant="heavy")
    sched.add_request(h1)
    out = sched.schedule()
    assert not out.preempted and h1 not in out.requests


def test_fair_lets_a_lumpy_lead_pass_when_the_flood_runs_far_over_its_share():
    # The flood has held every slot for a while; two light requests of 40 tokens come back
    # level with it and take a slot each: their prefills, charged at once, put light some 60
    # tokens ahead, more than a third light request's own tokens. But the flood, served 14
    # tokens a step to light's few, makes that up within the third request's life: the lead is
    # not real, and the third request takes a flood slot at once instead of waiting steps.
    sched = make(scheduling_policy="fair", max_num_seqs=16, max_num_batched_tokens=256)
    for i in range(20):
        sched.add_request(req(f"f{i}", 4, arrival=float(i), tenant="flood", max_tokens=1000))
    for _ in range(40):
        advance(sched, sched.schedule())
    for name in ("a", "b"):
        sched.add_request(req(name, 40, arrival=50.0, tenant="light", max_tokens=24))
    out = sched.schedule()
    assert len(out.preempted) == 2 and all(r.tenant == "flood" for r in out.preempted)
    advance(sched, out)
    virtual = sched.shares.virtual_time
    assert virtual("light") - virtual("flood") > 4  # ahead by more than the newcomer's tokens
    third = req("c", 4, arrival=60.0, tenant="light", max_tokens=24)
    sched.add_request(third)
    out = sched.schedule()
    assert third in out.requests
    assert [r.tenant for r in out.preempted] == ["flood"]


def test_admission_learns_from_waits_longer_than_predicted():
    # One slot, held by a request ending in 5 steps: a 200 ms first-token deadline behind it is
    # met by the cost model's account (50 ms of steps, then its own). Once a wait predicted so
    # turned out six times longer (the engine stalled), the same deadline is refused.
    def queue_behind_one(sched, name):
        sched.add_request(req(f"{name}-ahead", 4, max_tokens=5))
        advance(sched, sched.schedule())
        return req(name, 4, ttft_ms=200)

    fresh = make(cost=COST, max_num_seqs=1)
    fresh.add_request(queue_behind_one(fresh, "c"))  # admitted

    sched = make(cost=COST, max_num_seqs=1)
    waiter = queue_behind_one(sched, "b")
    sched.add_request(waiter)
    time.sleep(0.3)  # longer than the 50 ms predicted
    while waiter.status is not RequestStatus.RUNNING:
        advance(sched, sched.schedule())
    assert sched.queue_waits.ratio((waiter.tenant, waiter.priority)) > 4
    while sched.has_unfinished:
        advance(sched, sched.schedule())
    with pytest.raises(DeadlineUnmeetable):
        sched.add_request(queue_behind_one(sched, "c"))


def test_fair_a_tenant_far_behind_in_tokens_may_run_over_its_share_of_slots():
    # Light holds its share of the slots, two of four, and is ~190 tokens behind: a third light
    # request takes a heavy slot (the debt is real: heavy also gains on it at every step). The
    # heavy tenant, back within its share, takes none back: it is the one ahead.
    sched = make(scheduling_policy="fair", max_num_seqs=4, max_num_batched_tokens=256)
    for i in range(2):
        sched.add_request(req(f"h{i}", 100, arrival=float(i), tenant="heavy", max_tokens=1000))
        sched.add_request(req(f"l{i}", 4, arrival=2.0 + i, tenant="light", max_tokens=1000))
    advance(sched, sched.schedule())
    third = req("l2", 4, arrival=10.0, tenant="light", max_tokens=8)
    sched.add_request(third)
    out = sched.schedule()
    assert third in out.requests
    assert [r.request_id for r in out.preempted] == ["h1"]
    advance(sched, out)
    assert not sched.schedule().preempted


def test_fair_level_tenants_do_not_trade_slots():
    # Two floods of the same requests, each at its share of the slots: prefills charged at once
    # put one ahead of the other by a request now and then, which is no debt to preempt for.
    sched = make(scheduling_policy="fair", max_num_seqs=4, max_num_batched_tokens=64)
    computed = run_flood(sched, {"a": 1.0, "b": 1.0}, steps=300, max_tokens=6)
    assert sched.num_preemptions == 0
    assert computed["a"] / sum(computed.values()) == pytest.approx(0.5, rel=0.05), computed


def test_priority_admission_counts_on_preempting_behind_an_urgent_request_queued():
    # Less urgent requests hold both slots for a thousand steps. Two urgent ones with a 200 ms
    # deadline arrive before the next step: each takes a slot from them at its turn, so the
    # second is not refused for a slot the first would wait for.
    sched = make(cost=COST, scheduling_policy="priority", max_num_seqs=2)
    for i in range(2):
        sched.add_request(req(f"slow{i}", 4, priority=1, arrival=float(i), max_tokens=1000))
    advance(sched, sched.schedule())
    urgent = [req(f"urgent{i}", 4, arrival=10.0 + i, ttft_ms=200) for i in range(2)]
    for r in urgent:
        sched.add_request(r)
    out = sched.schedule()
    assert all(r in out.requests for r in urgent)
    # A third, with no less urgent request left running to take from, waits for a slot.
    with pytest.raises(DeadlineUnmeetable):
        sched.add_request(req("urgent2", 4, arrival=12.0, ttft_ms=200))
