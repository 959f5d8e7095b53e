"""Decides, each step, which requests advance and by how many tokens.

One token budget per step (max_num_batched_tokens) and a cap on running requests
(max_num_seqs; an n > 1 request counts as its n samples from admission on). Running requests
go first (a decode costs one token), then waiting ones; a prompt larger than the budget is
prefilled in chunks across steps. Prefill, chunked prefill, decode and recompute are one
motion: a request advances `num_computed_tokens` towards `num_tokens`. When the KV pool runs
out, running requests are preempted (blocks freed, request re-queued, recomputed later) by
policy: FCFS preempts the latest arrival, priority the least urgent (largest priority value,
then latest arrival), fair the least urgent of the tenant most over its share; the batch lane
(priority >= BATCH_PRIORITY) goes first whatever the policy, and runs only on what interactive
requests leave of a step. A waiting request that does not fit (KV blocks or sequence slots)
preempts batch requests, and under the priority policy running requests strictly less urgent
than itself, under fair those of a tenant well over its share.

Deadlines order the waiting queue (engine/core/waiting.py: earliest first within a priority),
and with a step cost model (engine/core/step_cost.py) a request whose deadline the queue ahead
of it already makes unmeetable is refused at admission.

An n > 1 request's samples replace it in the running list once its prompt is computed
(`fork`); from then on each is an ordinary request, preempted and recomputed on its own.

Its output is a plain-data step plan (engine.core.step_plan) that the model runner of every rank
consumes: the scheduler remembers what the runner's persistent batch holds of each request, so
a plan carries only what changed (requests joining whole, running ones' new token and block
ids, departures). It also fixes the batch order and which rows are sampled.

The scheduler never touches tensors or the model; it only moves requests between queues
and asks the KV cache manager for blocks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from common.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import EngineStats
from engine.core.prompt_logprobs import plan_span
from engine.core.request import Request, RequestStatus
from engine.core.step_cost import LiveStepCost, QueueWaits
from engine.core.step_plan import NewRequestPlan, RunningRequestPlan, StepPlan
from engine.core.waiting import BATCH, INTERACTIVE, FairShares, WaitingQueue
from engine.errors import DeadlineUnmeetable, InvalidRequestError


@dataclass
class SchedulerOutput:
    """One step: the plain-data plan every rank's runner consumes, and rank 0's live view of
    it (the engine's update and sampler need the Request objects)."""

    plan: StepPlan = field(default_factory=StepPlan)
    # Requests in the plan's batch order (decodes first).
    requests: list[Request] = field(default_factory=list)
    # The request each sampled logits row belongs to, in row order (an n > 1 request completing
    # its prompt contributes one row per live sample).
    sampling_requests: list[Request] = field(default_factory=list)
    # The embedding requests whose prompt this step completes, in batch order: no logits row,
    # the executor pools each instead (the plan's pooled_entries name every embedding request).
    pooling_requests: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> list[int]:
        return self.plan.num_new_tokens

    @property
    def num_decodes(self) -> int:
        return self.plan.num_decodes

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return self.plan.block_copies

    @property
    def total_tokens(self) -> int:
        return self.plan.total_tokens

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class _Shipped:
    """How much of a request the runner's batch holds: token ids and block ids sent so far."""

    num_tokens: int
    num_blocks: int


# For the admission estimate: how many tokens a request without max_tokens is taken to generate.
ASSUMED_OUTPUT_TOKENS = 256


def _wait_class(request: Request) -> tuple[str, int]:
    """Whose queue waits `request`'s is predicted from (QueueWaits)."""
    return request.tenant, request.priority


def _output_bound(request: Request) -> int:
    """The most tokens `request` generates, as far as the scheduler can tell."""
    max_tokens = request.sampling_params.max_tokens
    return ASSUMED_OUTPUT_TOKENS if max_tokens is None else max_tokens


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv_cache: KVCacheManager, step_cost: LiveStepCost | None = None
    ) -> None:
        """`step_cost`: how long steps take, to refuse at admission a request whose deadline
        the queue already makes unmeetable; None: deadlines only order the queue."""
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.policy = config.scheduling_policy
        self.kv_cache = kv_cache
        self.step_cost = step_cost
        self.shares = FairShares()
        self.waiting = WaitingQueue(
            config.scheduling_policy, config.max_waiting_requests, self.shares
        )
        self.running: list[Request] = []
        self.num_preemptions = 0
        # What the runner's persistent batch holds, and the requests that left it since the
        # last plan it received (told in the next non-empty plan).
        self._shipped: dict[Request, _Shipped] = {}
        self._finished_ids: list[int] = []
        self._preempted_ids: list[int] = []
        # Whether the waiting request at a lane's head may start now (the LoRA registry's: its
        # adapter has a slot); None: always.
        self.admission_gate: Callable[[Request], bool] | None = None
        self._truncations: list[tuple[int, int]] = []
        # The tokens of the step being planned, by request (empty between steps).
        self._planned: dict[Request, int] = {}
        # Waiting requests admitted with a deadline: the wait predicted for their first step,
        # that step's length and when (measured when they start, to correct later predictions).
        self._predicted_waits: dict[Request, tuple[float, float, float]] = {}
        self.queue_waits = QueueWaits()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seqs for r in self.running)

    def queued_prefill_tokens(self) -> int:
        """Prompt (and recompute) tokens admitted but not computed yet: the waiting requests'
        and what running ones still have to prefill."""
        return self._running_prefill_tokens() + sum(r.num_tokens for r in self.waiting)

    def _running_prefill_tokens(self) -> int:
        return sum(left for r in self.running if (left := r.num_tokens - r.num_computed_tokens) > 1)

    def stats(self) -> EngineStats:
        """Its queues' load, what a new request would wait for, and the KV cache's
        counters, between steps."""
        kv_cache, cost = self.kv_cache, self.step_cost
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv_cache.usage,
            num_kv_blocks=kv_cache.num_blocks,
            prefix_cache_queries=kv_cache.prefix_cache_queries,
            prefix_cache_hits=kv_cache.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            queued_prefill_tokens=self.queued_prefill_tokens(),
            prefill_token_seconds=cost.prefill_token_seconds if cost else 0.0,
            decode_step_seconds=cost.step_seconds(0, self.num_running_seqs) if cost else 0.0,
        )

    def add_request(self, request: Request) -> None:
        """Queue a request; QueueFullError when the queue is full, DeadlineUnmeetable when
        its deadline cannot be met behind the queue, InvalidRequestError when it cannot be met
        even by an idle engine."""
        predicted = self._check_deadline(request)
        self.waiting.add(request)
        self.shares.joined(request)
        if predicted is not None:
            self._predicted_waits[request] = (*predicted, time.monotonic())

    def _check_deadline(self, request: Request) -> tuple[float, float] | None:
        """Refuse a request whose deadline (the sooner of its two) cannot be met: below one
        step of its prompt (InvalidRequestError), or behind the prefill queued ahead of it
        (DeadlineUnmeetable, with how long until it could be). Else the seconds it is
        predicted to wait for its first step and that step's, None without a deadline or a
        cost model."""
        service, cost = request.service, self.step_cost
        given = [
            (ms, name)
            for name, ms in (("ttft_ms", service.ttft_ms), ("total_ms", service.total_ms))
            if ms is not None
        ]
        if cost is None or not given:
            return None
        ms, name = min(given)
        _, num_cached = self.kv_cache.get_cached_prefix(request)
        own = request.num_tokens - num_cached
        one_step = cost.step_seconds(min(own, self.max_num_batched_tokens), 0)
        if ms / 1000 < one_step:
            raise InvalidRequestError(
                f"slo_{name} leaves {ms:.3g} ms when the request reaches the engine, below one "
                f"engine step of its prompt ({one_step * 1e3:.1f} ms): it cannot be met",
                f"slo_{name}",
            )
        ahead = self.waiting.ahead_of(request)
        tokens = sum(r.num_tokens for r in ahead) + self._running_prefill_tokens() + own
        expected = cost.seconds_to_prefill(
            tokens, self.num_running_seqs, self.max_num_batched_tokens
        )
        # Allowed to preempt for a slot and next in line (under fair, whichever of the other
        # tenants' requests run first: its own tenant is within its share at its turn; under
        # priority, those ahead are as urgent and preempt too while less urgent ones run): it
        # need not wait for one to free.
        if self._victim_for(request) is None or (ahead and not self._preempts_past(request, ahead)):
            expected += self._seconds_to_free_slots(len(ahead) + 1, ahead, cost)
        # The queue's part, corrected by how waits predicted so have turned out lately.
        own_step = cost.step_seconds(min(own, self.max_num_batched_tokens), self.num_running_seqs)
        wait = max(0.0, expected - own_step)
        expected = own_step + wait * self.queue_waits.ratio(_wait_class(request))
        if expected > ms / 1000:
            raise DeadlineUnmeetable(
                f"slo_{name} leaves {ms:.3g} ms, but the first token is expected in "
                f"{expected * 1e3:.0f} ms behind the {len(self.waiting)} waiting and "
                f"{len(self.running)} running requests; retry later",
                retry_after=max(1, math.ceil(expected - ms / 1000)),
            )
        return wait, own_step

    def _observe_wait(
        self, request: Request, predicted: float, step: float, since: float, now: float
    ) -> None:
        """Correct later predictions by this request's wait, if it was predicted to wait a
        step or more for the queue (a shorter wait is the order inside a step and the engine
        loop's own time, not the queue's: no measure of a queue's error)."""
        if predicted >= step:
            self.queue_waits.observe(_wait_class(request), predicted, now - since)

    def _preempts_past(self, request: Request, ahead: list[Request]) -> bool:
        """Whether `request`, allowed to preempt, also starts without waiting for a slot
        behind the requests `ahead` of it: under fair always (those ahead are other tenants'
        at their turn); under priority while enough less urgent requests run for them all."""
        if self.policy == "fair":
            return True
        if self.policy == "priority":
            less_urgent = sum(r.priority > request.priority for r in self.running)
            return less_urgent > len(ahead)
        return False

    def _seconds_to_free_slots(
        self, needed: int, ahead: list[Request], cost: LiveStepCost
    ) -> float:
        """How long until `needed` sequence slots are free (the requests `ahead` of a new one,
        and it): running requests end after their max_tokens at the latest, soonest first;
        slots beyond theirs after rounds of the requests ahead."""
        needed -= self.max_num_seqs - self.num_running_seqs
        if needed <= 0 or not self.running:
            return 0.0
        left = sorted(max(1, _output_bound(r) - r.num_output_tokens) for r in self.running)
        steps = left[min(needed, len(left)) - 1]
        if needed > len(left):
            rounds = math.ceil((needed - len(left)) / self.max_num_seqs)
            steps += rounds * max(_output_bound(r) for r in ahead)
        return steps * cost.step_seconds(0, self.num_running_seqs)

    def finish(self, request: Request) -> None:
        """Drop a request (finished or aborted) from the queues and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        self._predicted_waits.pop(request, None)
        self._leave_batch(request, self._finished_ids)
        if request.parent is None:  # a sample's parent holds its tenant's place
            self.shares.left(request)

    def _leave_batch(self, request: Request, departures: list[int]) -> None:
        if self._shipped.pop(request, None) is not None:
            departures.append(request.seq_id)

    def schedule(self) -> SchedulerOutput:
        """Interactive running requests first (in admission order), then interactive waiting
        ones, then the batch lane's running and waiting ones: a batch request never takes the
        budget, the sequence slots or the KV blocks an interactive one asks for."""
        budget = self.max_num_batched_tokens
        chosen: dict[Request, int] = {}
        self._planned = chosen
        preempted: list[Request] = []

        def preempt(victim: Request) -> None:
            nonlocal budget
            if victim in chosen:
                budget += chosen.pop(victim)
            self._preempt(victim)
            preempted.append(victim)

        def advance(running: list[Request]) -> None:
            nonlocal budget
            for request in running:
                if budget <= 0:
                    break
                if request.status is not RequestStatus.RUNNING:
                    continue  # preempted earlier in this step
                left = request.num_tokens - request.num_computed_tokens
                num_new = min(left + len(request.spec_token_ids), budget)
                while not self.kv_cache.allocate(request, num_new):
                    if request.spec_token_ids:  # drafts give way before any request does
                        request.spec_token_ids = []
                        num_new = min(left, budget)
                        continue
                    victim = self._pick_victim(batch_only=request.is_batch)
                    preempt(victim)
                    if victim is request:
                        break
                else:
                    # The budget may cut the drafts short: those past it are not verified.
                    del request.spec_token_ids[num_new - left :]
                    chosen[request] = num_new
                    budget -= num_new

        def admit(lane: int) -> None:
            nonlocal budget
            # Under fair, tenants whose head cannot start now: the next tenant's may (a tenant
            # within its share preempts one over it), so one blocked head holds up no other.
            blocked: set[str] = set()
            while budget > 0 and (request := self._next_waiting(lane, blocked)) is not None:
                if self.admission_gate is not None and not self.admission_gate(request):
                    return
                cached_blocks, num_cached = self.kv_cache.get_cached_prefix(request)
                num_new = min(request.num_tokens - num_cached, budget)
                # Preempted in this step: it starts again in a later one (no churn, no loop).
                startable = request not in preempted
                while startable and (
                    self.num_running_seqs + request.num_seqs > self.max_num_seqs
                    or not self.kv_cache.allocate(request, num_new, cached_blocks)
                ):
                    victim = self._victim_for(request)
                    if victim is None:
                        startable = False
                        break
                    preempt(victim)
                if not startable:
                    if self.policy != "fair":
                        return
                    blocked.add(request.tenant)
                    continue
                # A victim put back may now come first in the lane (under fair, its tenant can
                # be behind in tokens while over its share of slots): take `request` itself.
                if self.waiting.peek(lane, blocked) is request:
                    self.waiting.pop(lane, blocked)
                else:
                    self.waiting.remove(request)
                request.num_computed_tokens = num_cached
                request.num_cached_tokens = num_cached
                request.status = RequestStatus.RUNNING
                if request.times.first_scheduled is None:
                    request.times.first_scheduled = now = time.monotonic()
                    if (predicted := self._predicted_waits.pop(request, None)) is not None:
                        self._observe_wait(request, *predicted, now)
                self.running.append(request)
                chosen[request] = num_new
                budget -= num_new

        advance([r for r in self.running if not r.is_batch])
        # Waiting requests only while memory sufficed for the running interactive ones.
        if all(r.is_batch for r in preempted):
            admit(INTERACTIVE)
        advance([r for r in self.running if r.is_batch])
        if not preempted and self.waiting.lane_size(INTERACTIVE) == 0:
            admit(BATCH)
        self._planned = {}
        if self.policy == "fair":
            self.shares.charge_step((r.tenant, num_new) for r, num_new in chosen.items())
        return self._batch(chosen, preempted)

    def _next_waiting(self, lane: int, blocked: set[str]) -> Request | None:
        """The waiting request to admit next in `lane`: by policy; under fair, a tenant within
        its share of the sequence slots before those at it (a free slot given to a tenant at
        its share would be taken back at once by one within its own)."""
        if self.policy == "fair":
            seqs = self._seqs_by_tenant()
            waiting = self.waiting.tenants(lane)
            share = self._slot_shares({*seqs, *waiting})
            at_share = {t for t in waiting if seqs[t] + 1 > share[t]}
            if (request := self.waiting.peek(lane, blocked | at_share)) is not None:
                return request
        return self.waiting.peek(lane, blocked)

    def fork(self, parent: Request) -> list[Request]:
        """Replace a running n > 1 request whose prompt is computed by its live samples: each
        shares the parent's KV blocks and continues from its computed tokens; the parent
        holds nothing afterwards."""
        samples = list(parent.samples)
        for sample in samples:
            self.kv_cache.fork(parent, sample)
            sample.num_computed_tokens = parent.num_computed_tokens
            sample.num_cached_tokens = parent.num_cached_tokens
            sample.prompt_logprobs = parent.prompt_logprobs
            sample.times = dataclasses.replace(parent.times)
            sample.status = RequestStatus.RUNNING
        position = self.running.index(parent)
        self.running[position : position + 1] = samples
        self.kv_cache.free(parent)
        parent.status = RequestStatus.FINISHED
        self._leave_batch(parent, self._finished_ids)
        return samples

    def _pick_victim(self, batch_only: bool = False) -> Request:
        """The running request to preempt when memory runs out: the batch lane's least urgent
        first; else by policy, the latest admitted (fcfs), the least urgent (priority), the
        most over-served tenant's least urgent (fair)."""
        batch = [r for r in self.running if r.is_batch]
        if batch or batch_only:
            return max(batch, key=lambda r: (r.priority, r.times.arrival))
        if self.policy == "fcfs":
            return self.running[-1]
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.times.arrival))
        virtual = self.shares.virtual_time
        return max(self.running, key=lambda r: (virtual(r.tenant), r.priority, r.times.arrival))

    def _victim_for(self, request: Request) -> Request | None:
        """The running request to preempt so that the waiting `request` can start, if any: a
        batch one for an interactive request; under priority, the least urgent if strictly
        less urgent than `request`; under fair, one of the tenant most over its share of the
        sequence slots, while `request`'s tenant is within its own."""
        if request.is_batch or not self.running:
            return None
        victim = self._pick_victim()
        if victim.is_batch:
            return victim
        if self.policy == "priority":
            return victim if victim.priority > request.priority else None
        if self.policy == "fair":
            return self._over_share_victim(request)
        return None

    def _over_share_victim(self, request: Request) -> Request | None:
        """Under fair, the running request `request` may take the slot of (the latest admitted
        of another tenant's), if any; else None (it waits for a free slot).

        Within its weighted share of max_num_seqs with `request` running too, its tenant takes
        from the tenant running the most sequences over its own share, unless ahead of it in
        tokens served (virtual time) by more than `request`'s own tokens both now and at the
        end of `request`'s life at the rates the two are served lately, or that tenant is
        as far behind it. Over its share, it takes from the tenant furthest ahead in tokens
        only if that far behind it: a real debt, not the lumpiness of prefills charged at
        once, so the tenants do not trade slots back and forth."""
        seqs = self._seqs_by_tenant()
        others = [t for t in seqs if t != request.tenant]
        if not others:
            return None
        weight, virtual = self.shares.weight, self.shares.virtual_time
        fair_seqs = self._slot_shares({*seqs, request.tenant})

        def latest_of(tenant: str) -> Request:
            return max(
                (r for r in self.running if r.tenant == tenant), key=lambda r: r.times.arrival
            )

        if seqs[request.tenant] + request.num_seqs > fair_seqs[request.tenant]:
            ahead = max(others, key=virtual)
            return latest_of(ahead) if self._really_behind(request, ahead) else None
        over = max(others, key=lambda t: seqs[t] - fair_seqs[t])
        if seqs[over] <= fair_seqs[over]:
            return None
        victim = latest_of(over)
        now, end = self._leads(request, over)
        if min(now, end) > request.num_tokens / weight(request.tenant):
            return None
        return None if self._really_behind(victim, request.tenant) else victim

    def _seqs_by_tenant(self) -> Counter[str]:
        """The sequences each tenant has running."""
        seqs = Counter[str]()
        for running in self.running:
            seqs[running.tenant] += running.num_seqs
        return seqs

    def _slot_shares(self, tenants: set[str]) -> dict[str, float]:
        """Each of `tenants`' weighted share of max_num_seqs among them."""
        weight = self.shares.weight
        total_weight = sum(weight(t) for t in tenants)
        return {t: self.max_num_seqs * weight(t) / total_weight for t in tenants}

    def _leads(self, request: Request, other: str) -> tuple[float, float]:
        """`request`'s tenant's lead over `other` in tokens served (virtual time, counting the
        tokens this step plans so far), now and at the end of `request`'s life at the rates
        the two are served lately, were `request` to take a slot of `other`'s (the swap moves
        one decode a step between them)."""
        shares = self.shares
        planned = Counter[str]()
        for chosen, num_new in self._planned.items():
            planned[chosen.tenant] += num_new

        def virtual(tenant: str) -> float:
            return shares.virtual_time(tenant) + planned[tenant] / shares.weight(tenant)

        now = virtual(request.tenant) - virtual(other)
        mine = (shares.rate(request.tenant) + request.num_seqs) / shares.weight(request.tenant)
        theirs = (shares.rate(other) - request.num_seqs) / shares.weight(other)
        return now, now + (mine - theirs) * _output_bound(request)

    def _really_behind(self, request: Request, other: str) -> bool:
        """Whether `request`'s tenant is behind `other` by more than `request`'s own tokens
        now, and further behind at the end of its life even with the slot (_leads)."""
        now, end = self._leads(request, other)
        return end < now < -request.num_tokens / self.shares.weight(request.tenant)

    def roll_back(self, request: Request) -> None:
        """After verification rejected some of the request's drafts (its num_computed_tokens
        already counts only accepted ones): the blocks only rejected drafts reached go back to
        the pool, and the runner's row hears of it in the next plan."""
        if self.kv_cache.trim(request, request.num_computed_tokens):
            num_blocks = len(request.block_table)
            shipped = self._shipped.get(request)
            if shipped is not None and shipped.num_blocks > num_blocks:
                shipped.num_blocks = num_blocks
                self._truncations.append((request.seq_id, num_blocks))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)
        self._leave_batch(request, self._preempted_ids)

    def _batch(self, chosen: dict[Request, int], preempted: list[Request]) -> SchedulerOutput:
        """The step's plan and its live view. Batch order: decodes first, by context length
        (the attention backend groups them with little padding), then the rest as chosen."""
        out = SchedulerOutput(preempted=preempted)
        copies = self.kv_cache.take_block_copies()
        if not chosen:
            # No forward: the copies were for requests this step preempted (their blocks are
            # free again); departures wait for the next plan the runner receives.
            return out
        decodes = sorted(
            (r for r, n in chosen.items() if n == 1), key=attrgetter("num_computed_tokens")
        )
        requests = out.requests = decodes + [r for r, n in chosen.items() if n != 1]
        plan = out.plan
        plan.num_decodes = len(decodes)
        plan.block_copies = copies
        plan.finished_ids, self._finished_ids = self._finished_ids, []
        plan.preempted_ids, self._preempted_ids = self._preempted_ids, []
        plan.block_truncations, self._truncations = self._truncations, []
        plan.scheduled_ids = [r.seq_id for r in requests]
        plan.num_computed_tokens = computed = [r.num_computed_tokens for r in requests]
        plan.num_new_tokens = num_new = [chosen[r] for r in requests]
        # Hot at every step: one pass, locals only (a decode's delta is its one new token).
        num_samples, sampling = plan.num_samples, out.sampling_requests
        joining, running, shipped_of = plan.new_requests, plan.running_requests, self._shipped
        if any(r.spec_token_ids for r in requests):
            plan.num_spec_tokens = [len(r.spec_token_ids) for r in requests]
        for index, (request, start, count) in enumerate(
            zip(requests, computed, num_new, strict=True)
        ):
            tokens, table, drafts = request.token_ids, request.block_table, request.spec_token_ids
            if drafts:
                plan.spec_token_ids += drafts
                count -= len(drafts)  # its known tokens: the drafts follow them
            shipped = shipped_of.get(request)
            if shipped is None:
                joining.append(
                    NewRequestPlan(
                        request.seq_id,
                        list(tokens),
                        list(table),
                        start,
                        request.sampling_params,
                        request.lora_slot,
                    )
                )
                shipped_of[request] = _Shipped(len(tokens), len(table))
            else:
                running.append(
                    RunningRequestPlan(
                        request.seq_id, tokens[shipped.num_tokens :], table[shipped.num_blocks :]
                    )
                )
                shipped.num_tokens, shipped.num_blocks = len(tokens), len(table)
            if request.pooling is not None:
                plan.pooled_entries.append(index)
                num_samples.append(0)
                if start + count == len(tokens):
                    out.pooling_requests.append(request)
            elif start + count == len(tokens):
                if request.samples:
                    num_samples.append(len(request.samples))
                    sampling.extend(request.samples)
                else:
                    num_samples.append(1)
                    sampling.append(request)
            else:
                num_samples.append(0)
            if request.sampling_params.prompt_logprobs is not None and (
                span := plan_span(request, index, start, start + count)
            ):
                plan.prompt_logprob_spans.append(span)
        return out
