"""Decides, each step, which requests advance and by how many tokens.

One token budget per step (max_num_batched_tokens) and a cap on running requests
(max_num_seqs). Running requests go first (a decode costs one token), then waiting ones;
a prompt larger than the budget is prefilled in chunks across steps. Prefill, chunked
prefill, decode and recompute are one motion: a request advances `num_computed_tokens`
towards `num_tokens`. When the KV pool runs out, running requests are preempted (blocks
freed, request re-queued, recomputed later) by policy: FCFS preempts the latest arrival,
priority the least urgent (largest priority value, then latest arrival).

The scheduler never touches tensors or the model; it only moves requests between queues
and asks the KV cache manager for blocks.
"""

from __future__ import annotations

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

        # Running requests first, in admission order.
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate(request, num_new):
                victim = self._pick_victim()
                if victim in chosen:
                    budget += chosen.pop(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                chosen[request] = num_new
                budget -= num_new

        # Then waiting requests, unless memory was short this step.
        while (
            not preempted
            and budget > 0
            and len(self.waiting) > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting.peek()
            cached_blocks, num_cached = self.kv_cache.get_cached_prefix(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate(request, num_new, cached_blocks):
                break
            self.waiting.pop()
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = time.monotonic()
            self.running.append(request)
            chosen[request] = num_new
            budget -= num_new

        return self._batch(chosen, preempted)

    def _pick_victim(self) -> Request:
        if self.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=lambda r: (r.priority, r.times.arrival))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)

    @staticmethod
    def _batch(chosen: dict[Request, int], preempted: list[Request]) -> SchedulerOutput:
        out = SchedulerOutput(preempted=preempted)
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
