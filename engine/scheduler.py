"""Decides, each step, which requests advance and by how many tokens.

One token budget per step (max_num_batched_tokens) and a cap on running requests
(max_num_seqs; an n > 1 request counts as its n samples from admission on). Running requests
go first (a decode costs one token), then waiting ones; a prompt larger than the budget is
prefilled in chunks across steps. Prefill, chunked prefill, decode and recompute are one
motion: a request advances `num_computed_tokens` towards `num_tokens`. When the KV pool runs
out, running requests are preempted (blocks freed, request re-queued, recomputed later) by
policy: FCFS preempts the latest arrival, priority the least urgent (largest priority value,
then latest arrival). Under the priority policy a waiting request that does not fit (KV blocks
or sequence slots) also preempts running requests strictly less urgent than itself.

An n > 1 request's samples replace it in the running list once its prompt is computed
(`fork`); from then on each is an ordinary request, preempted and recomputed on its own.

The scheduler never touches tensors or the model; it only moves requests between queues
and asks the KV cache manager for blocks.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from common.config import EngineConfig
from engine.errors import QueueFullError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one step computes: requests in batch order (decodes first) and their token counts."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # The first num_decodes requests have exactly one new token.
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)
    # Copy-on-write (source, destination) KV block copies to perform before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class WaitingQueue:
    """The bounded queue of requests not holding KV blocks, ordered by policy.

    FCFS: arrival order, preempted requests go back to the front. Priority: lowest
    `priority` first, then arrival.
    """

    def __init__(self, policy: str, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def add(self, request: Request) -> None:
        if len(self) >= self.capacity:
            raise QueueFullError(
                f"the waiting queue is full ({self.capacity} requests, max_waiting_requests); "
                "retry later"
            )
        self._push(request, front=False)

    def requeue(self, request: Request) -> None:
        """Put back a preempted request; never refused, it was already admitted once."""
        self._push(request, front=True)

    def _push(self, request: Request, front: bool) -> None:
        if self.policy == "fcfs":
            (self._fifo.appendleft if front else self._fifo.append)(request)
        else:
            key = (request.priority, request.times.arrival, next(self._counter), request)
            heapq.heappush(self._heap, key)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> bool:
        if self.policy == "fcfs":
            try:
                self._fifo.remove(request)
            except ValueError:
                return False
            return True
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.policy = config.scheduling_policy
        self.kv_cache = kv_cache
        self.waiting = WaitingQueue(config.scheduling_policy, config.max_waiting_requests)
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seqs for r in self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.add(request)

    def finish(self, request: Request) -> None:
        """Drop a request (finished or aborted) from the queues and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chosen: dict[Request, int] = {}
        preempted: list[Request] = []

        def preempt(victim: Request) -> None:
            nonlocal budget
            if victim in chosen:
                budget += chosen.pop(victim)
            self._preempt(victim)
            preempted.append(victim)

        # Running requests first, in admission order.
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate(request, num_new):
                victim = self._pick_victim()
                preempt(victim)
                if victim is request:
                    break
            else:
                chosen[request] = num_new
                budget -= num_new

        # Then waiting requests, unless memory was short for the running ones this step.
        admitting = not preempted
        while admitting and budget > 0 and len(self.waiting) > 0:
            request = self.waiting.peek()
            cached_blocks, num_cached = self.kv_cache.get_cached_prefix(request)
            num_new = min(request.num_tokens - num_cached, budget)
            while (
                self.num_running_seqs + request.num_seqs > self.max_num_seqs
                or not self.kv_cache.allocate(request, num_new, cached_blocks)
            ):
                victim = self._less_urgent_victim(request)
                if victim is None:
                    admitting = False
                    break
                preempt(victim)
            else:
                self.waiting.pop()
                request.num_computed_tokens = num_cached
                request.num_cached_tokens = num_cached
                request.status = RequestStatus.RUNNING
                if request.times.first_scheduled is None:
                    request.times.first_scheduled = time.monotonic()
                self.running.append(request)
                chosen[request] = num_new
                budget -= num_new

        return self._batch(chosen, preempted, self.kv_cache.take_block_copies())

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
        return samples

    def _pick_victim(self) -> Request:
        if self.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=lambda r: (r.priority, r.times.arrival))

    def _less_urgent_victim(self, request: Request) -> Request | None:
        """Under the priority policy, the running request to preempt so that the waiting
        `request` can start: the least urgent one, if strictly less urgent than `request`."""
        if self.policy != "priority" or not self.running:
            return None
        victim = self._pick_victim()
        return victim if victim.priority > request.priority else None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)

    @staticmethod
    def _batch(
        chosen: dict[Request, int], preempted: list[Request], block_copies: list[tuple[int, int]]
    ) -> SchedulerOutput:
        out = SchedulerOutput(preempted=preempted, block_copies=block_copies)
        rest: list[tuple[Request, int]] = []
        for request, num_new in chosen.items():
            if num_new == 1:
                out.requests.append(request)
                out.num_new_tokens.append(1)
            else:
                rest.append((request, num_new))
        out.num_decodes = len(out.requests)
        for request, num_new in rest:
            out.requests.append(request)
            out.num_new_tokens.append(num_new)
        return out
