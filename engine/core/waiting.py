"""The waiting queue: requests not holding KV blocks, in the order the scheduling policy runs
them, and the fair policy's books of what each tenant has been served.

Two lanes: interactive requests, and the batch lane (priority >= BATCH_PRIORITY), which the
scheduler admits only when no interactive request waits. Within a lane, by policy:

- fcfs: preempted requests first, then the earliest deadline (engine/core/request.py), then
  arrival; requests without deadlines keep arrival order, as before deadlines existed.
- priority: lowest `priority` first, then as fcfs.
- fair: the tenant furthest behind its share first (least virtual time: tokens computed for it
  divided by its weight), then within the tenant as priority.

Ordering and bookkeeping only: it never allocates KV blocks and never decides to preempt.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Collection, Iterable, Iterator

from engine.core.request import Request
from engine.errors import QueueFullError

INTERACTIVE, BATCH = 0, 1  # the lanes
# Weight of one step in a tenant's running rate of tokens computed: about the last 20 count.
RATE_WEIGHT = 0.05
LANES = (INTERACTIVE, BATCH)

# (priority or 0, 0 if put back after preemption else 1, deadline, arrival, counter), request
_Entry = tuple[tuple[int, int, float, float, int], Request]


def lane_of(request: Request) -> int:
    return BATCH if request.is_batch else INTERACTIVE


class FairShares:
    """Per tenant, its virtual time: the tokens computed for it divided by its weight; and its
    rate lately, tokens computed a step.

    A tenant that comes back after having nothing live starts no further behind than the least
    served live tenant (it cannot bank idle time and then starve the others); one with no debt
    left is forgotten when its last request ends, so the books stay as small as the live set.
    """

    def __init__(self) -> None:
        self._virtual: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._live: Counter[str] = Counter()  # tenant -> its requests waiting or running
        self._rate: dict[str, float] = {}

    def joined(self, request: Request) -> None:
        tenant = request.tenant
        self._weight[tenant] = request.service.weight  # the latest word on its weight
        if not self._live[tenant]:
            floor = self._least_live_virtual()
            own = self._virtual.get(tenant, 0.0)
            self._virtual[tenant] = own if floor is None else max(own, floor)
        self._live[tenant] += 1

    def left(self, request: Request) -> None:
        tenant = request.tenant
        self._live[tenant] -= 1
        if self._live[tenant] > 0:
            return
        del self._live[tenant]
        floor = self._least_live_virtual()
        if floor is None or self._virtual.get(tenant, 0.0) <= floor:
            self._virtual.pop(tenant, None)
            self._weight.pop(tenant, None)
            self._rate.pop(tenant, None)

    def charge_step(self, computed: Iterable[tuple[str, int]]) -> None:
        """One step computed these (tenant, tokens): prompt, recomputed or generated."""
        step = Counter[str]()
        for tenant, num_tokens in computed:
            step[tenant] += num_tokens
        for tenant, num_tokens in step.items():
            self._virtual[tenant] = self.virtual_time(tenant) + num_tokens / self.weight(tenant)
        for tenant in self._rate.keys() | step.keys():
            rate = self._rate.get(tenant, 0.0)
            self._rate[tenant] = rate + RATE_WEIGHT * (step[tenant] - rate)

    def rate(self, tenant: str) -> float:
        """Tokens computed for `tenant` a step, lately."""
        return self._rate.get(tenant, 0.0)

    def virtual_time(self, tenant: str) -> float:
        return self._virtual.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self._weight.get(tenant, 1.0)

    def others_weight(self, tenant: str) -> float:
        """The weights of the other tenants with requests live, summed."""
        return sum(self.weight(t) for t in self._live if t != tenant)

    def _least_live_virtual(self) -> float | None:
        return min((self.virtual_time(t) for t in self._live), default=None)


class WaitingQueue:
    """The bounded queue of requests not holding KV blocks, ordered by policy (module doc)."""

    def __init__(self, policy: str, capacity: int, shares: FairShares) -> None:
        self.policy = policy
        self.capacity = capacity
        self.shares = shares
        # lane -> tenant -> heap (one tenant, "", except under the fair policy)
        self._heaps: tuple[dict[str, list[_Entry]], ...] = ({}, {})
        self._size = 0
        self._counter = itertools.count()

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        for lane in self._heaps:
            for heap in lane.values():
                for _key, request in heap:
                    yield request

    def tenants(self, lane: int) -> set[str]:
        """The tenants with requests waiting in `lane` (one, "", except under fair)."""
        return {tenant for tenant, heap in self._heaps[lane].items() if heap}

    def lane_size(self, lane: int) -> int:
        return sum(len(heap) for heap in self._heaps[lane].values())

    def add(self, request: Request) -> None:
        if self._size >= self.capacity:
            raise QueueFullError(
                f"the waiting queue is full ({self.capacity} requests, max_waiting_requests); "
                "retry later"
            )
        self._push(request, front=False)

    def requeue(self, request: Request) -> None:
        """Put back a preempted request; never refused, it was already admitted once."""
        self._push(request, front=True)

    def key(self, request: Request, front: bool = False) -> tuple[int, int, float, float, int]:
        """Where `request` stands in its lane (its tenant's, under fair): smaller runs first."""
        priority = 0 if self.policy == "fcfs" else request.priority
        return (priority, 0 if front else 1, request.deadline, request.times.arrival, 0)

    def _push(self, request: Request, front: bool) -> None:
        priority, put_back, deadline, arrival, _ = self.key(request, front)
        key = (priority, put_back, deadline, arrival, next(self._counter))
        heap = self._heaps[lane_of(request)].setdefault(self._tenant(request), [])
        heapq.heappush(heap, (key, request))
        self._size += 1

    def _tenant(self, request: Request) -> str:
        return request.tenant if self.policy == "fair" else ""

    def _heap(self, lane: int | None, skip: Collection[str]) -> list[_Entry] | None:
        """The heap whose head runs next in `lane` (None: the first lane with requests): under
        fair, the tenant least served, passing over the tenants in `skip`."""
        if lane is None:
            lane = INTERACTIVE if self.lane_size(INTERACTIVE) else BATCH
        if self.policy != "fair":
            skip = ()  # one heap, tenant ""
        heaps = [heap for tenant, heap in self._heaps[lane].items() if heap and tenant not in skip]
        if not heaps:
            return None
        if self.policy != "fair":
            return heaps[0]
        return min(heaps, key=lambda h: (self.shares.virtual_time(h[0][1].tenant), h[0][0]))

    def peek(self, lane: int | None = None, skip: Collection[str] = ()) -> Request | None:
        """The request that runs next in `lane`; under fair, of a tenant not in `skip` (one
        whose head cannot start now must not hold up the others')."""
        heap = self._heap(lane, skip)
        return None if heap is None else heap[0][1]

    def pop(self, lane: int | None = None, skip: Collection[str] = ()) -> Request:
        heap = self._heap(lane, skip)
        assert heap is not None, "pop from an empty lane"
        self._size -= 1
        return heapq.heappop(heap)[1]

    def remove(self, request: Request) -> bool:
        heaps = self._heaps[lane_of(request)]
        tenant = self._tenant(request)
        heap = heaps.get(tenant, [])
        for i, (_key, queued) in enumerate(heap):
            if queued is request:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                if not heap:
                    del heaps[tenant]
                self._size -= 1
                return True
        return False

    def ahead_of(self, request: Request) -> list[Request]:
        """The waiting requests that would run before `request` (not yet queued): those ahead
        of it in its lane (and the whole interactive lane for a batch request); under fair, its
        tenant's ahead of it and, in their order, what the other tenants get meanwhile by their
        weights (as many of their tokens as its tenant's times their weight over its own)."""
        key = self.key(request)[:4]
        lane = lane_of(request)
        ahead = [] if lane == INTERACTIVE else list(self._lane(INTERACTIVE))
        if self.policy != "fair":
            return ahead + [q for k, q in self._heaps[lane].get("", []) if k[:4] < key]
        own = [q for k, q in self._heaps[lane].get(request.tenant, []) if k[:4] < key]
        budget = (request.num_tokens + sum(q.num_tokens for q in own)) * (
            self.shares.others_weight(request.tenant) / request.service.weight
        )
        others = sorted(
            (
                entry
                for t, heap in self._heaps[lane].items()
                if t != request.tenant
                for entry in heap
            ),
            key=lambda entry: entry[0],
        )
        for _key, queued in others:
            if budget <= 0:
                break
            ahead.append(queued)
            budget -= queued.num_tokens
        return ahead + own

    def _lane(self, lane: int) -> Iterator[Request]:
        for heap in self._heaps[lane].values():
            for _key, request in heap:
                yield request
