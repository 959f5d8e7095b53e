"""Which engine replica a request goes to: the routing policies, over a prefix index and loads.

The PrefixIndex maps block hash (common/block_hash.py, as the engines compute it) -> the replicas
whose prefix cache holds that block, in the KV pool (medium "GPU") or in the host tier under it
(medium "CPU", --kv-offload-gib); the engines' KV events keep it current
(gateway/engines/replicas.py feeds it). A policy chooses among candidate replicas given the prompt's
block hashes, the index and each replica's load:

- round_robin: each in turn.
- least_load: the least loaded (ties in turn).
- cache_aware: the replica where this request's first token is expected soonest: the prompt
  tokens queued there and not computed yet, plus this prompt's tokens that replica does not
  hold in its prefix cache (a block its host tier holds counts HOST_BLOCK_COST of a block to
  compute: it is loaded, not computed), at that replica's measured prefill rate, plus the steps
  its decoding sequences stretch (a replica that has run too few steps for its timings to be
  its own is timed at the scale of the one that ran the most; while none has, timings are not
  compared at all: counts decide, as below); a replica whose KV cache could
  not hold that work without preempting is avoided (a hard limit) while another can. Expected
  times within a step of the best are a tie, won by the replica holding the most leading
  blocks (in its pool, then in its host tier), then by one where the request's LoRA adapter is
  resident (in a slot: no swap before it runs), then the least loaded. Engines that do not
  report step timings, or none of which has settled, are weighed by request counts: replicas
  over the load
  threshold skipped, the longest worthwhile prefix, ties to a replica with the adapter resident,
  then to the least loaded (a block in a host tier saving 1 - HOST_BLOCK_COST of one in the
  pool); with no worthwhile prefix, among the replicas under the threshold those with the
  adapter resident first.

Pure decisions: this module never talks to a service and never waits. Every decision says why,
for the debug log.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.config import ROUTING_POLICIES

# cache_aware: a replica whose load is over max(BALANCE_ABS, BALANCE_REL x the mean load of the
# candidates) is skipped while another is not; a match counts when it covers at least
# MIN_MATCH_SHARE of the prompt's full blocks (below that, load alone decides).
BALANCE_ABS = 4.0
BALANCE_REL = 1.5
MIN_MATCH_SHARE = 0.25
# cache_aware: what loading a block from a replica's host tier costs, as a share of computing it
# (a copy, and on the CPU a dequantization, against a forward through every layer): a replica
# holding a prefix there is scored between one holding it in the pool and one holding nothing.
HOST_BLOCK_COST = 0.1
# cache_aware: an engine's step timings are its step cost model rescaled to the steps it
# measured, over about the last 50 (engine/core/step_cost.py); until it has run this many it
# still reports mostly the model it started from, which may be several times off (a fresh
# replica looked 3x slower than a busy one in bench routing and got no request at all). Two
# fresh replicas' timings differ by more than a short prefix's prefill saves, so until one of
# them has settled, routing goes by counts and prefixes.
SETTLED_STEPS = 100
MEDIUM_POOL, MEDIUM_HOST = "GPU", "CPU"  # the KV events' mediums (engine.core.kv_events)


@dataclass(frozen=True)
class ReplicaLoad:
    """What a replica has on its hands: what the engine last said (GetStats) it runs and
    queues, with its KV cache usage, and the requests this gateway sent it since that answer
    (which the answer could not count yet: `unreported`; `unreported_tokens`: the prompt
    tokens it still has to compute for those without a first output yet, what its prefix
    cache was found to hold not counted);
    what it said of its step times, and its sizes (0: unknown)."""

    unreported: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    unreported_tokens: int = 0
    queued_prefill_tokens: int = 0
    prefill_token_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    num_kv_blocks: int = 0
    block_size: int = 0
    token_budget: int = 0  # max_num_batched_tokens
    measured_steps: int = 0  # steps the engine has run (and timed) since it started
    # The request's LoRA adapter sits in one of its slots (False for base-model requests).
    adapter_resident: bool = False

    @property
    def timed(self) -> bool:
        """Whether the engine reports step timings to estimate with."""
        return self.decode_step_seconds > 0

    def timed_like(self, reference: ReplicaLoad) -> ReplicaLoad:
        """This load with its step timings at `reference`'s scale (the same model measured
        there; its own decode load kept)."""
        scale = reference.prefill_token_seconds / self.prefill_token_seconds
        return dataclasses.replace(
            self,
            prefill_token_seconds=reference.prefill_token_seconds,
            decode_step_seconds=self.decode_step_seconds * scale,
        )

    def expected_ttft(self, new_tokens: int) -> float:
        """Seconds until the first token of a request with `new_tokens` uncached prompt tokens
        placed here: the prefill queued ahead and its own, in steps beside the decodes."""
        tokens = self.queued_prefill_tokens + self.unreported_tokens + new_tokens
        steps = max(1, math.ceil(tokens / self.token_budget)) if self.token_budget else 1
        return tokens * self.prefill_token_seconds + steps * self.decode_step_seconds

    def fits(self, new_tokens: int) -> bool:
        """Whether its KV cache holds the queued prefill and `new_tokens` more beside what runs
        (else it would have to preempt); unknown sizes fit."""
        if not (self.num_kv_blocks and self.block_size):
            return True
        tokens = self.queued_prefill_tokens + self.unreported_tokens + new_tokens
        needed = math.ceil(tokens / self.block_size) / self.num_kv_blocks
        return self.kv_usage + needed <= 1.0

    @property
    def requests(self) -> float:
        # The engine's count covers every gateway (and every worker of one) alike, so they all
        # weigh a replica the same; only what this one sent since adds to it, so that a burst
        # between two polls does not all go to the replica that was idle at the last one.
        return float(self.running + self.waiting + self.unreported)


@dataclass(frozen=True)
class Decision:
    replica: int
    matched_blocks: int  # leading blocks of the prompt the chosen replica holds
    reason: str


class PrefixIndex:
    """Block hash -> replicas holding it, per medium (the pool's, the host tier's), fed from
    KV events."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[int]] = {}
        self._blocks: dict[int, set[bytes]] = {}  # replica -> its blocks, to clear it
        self._host_holders: dict[bytes, set[int]] = {}
        self._host_blocks: dict[int, set[bytes]] = {}

    def _of(self, medium: str) -> tuple[dict[bytes, set[int]], dict[int, set[bytes]]]:
        if medium == MEDIUM_HOST:
            return self._host_holders, self._host_blocks
        return self._holders, self._blocks

    def stored(
        self, replica: int, block_hashes: Iterable[bytes], medium: str = MEDIUM_POOL
    ) -> None:
        all_holders, blocks = self._of(medium)
        mine = blocks.setdefault(replica, set())
        for block_hash in block_hashes:
            all_holders.setdefault(block_hash, set()).add(replica)
            mine.add(block_hash)

    def removed(
        self, replica: int, block_hashes: Iterable[bytes], medium: str = MEDIUM_POOL
    ) -> None:
        all_holders, blocks = self._of(medium)
        mine = blocks.get(replica, set())
        for block_hash in block_hashes:
            holders = all_holders.get(block_hash)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del all_holders[block_hash]
            mine.discard(block_hash)

    def clear(self, replica: int) -> None:
        for medium in (MEDIUM_POOL, MEDIUM_HOST):
            blocks = self._of(medium)[1]
            self.removed(replica, list(blocks.pop(replica, ())), medium)

    def num_blocks(self, replica: int) -> int:
        return len(self._blocks.get(replica, ()))

    def match(self, block_hashes: Sequence[bytes]) -> dict[int, int]:
        """Replica -> how many leading blocks of `block_hashes` it holds (those holding any)."""
        matched: dict[int, int] = {}
        alive: set[int] | None = None
        for depth, block_hash in enumerate(block_hashes):
            holders = self._holders.get(block_hash)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth + 1
        return matched

    def match_tiers(self, block_hashes: Sequence[bytes]) -> dict[int, tuple[int, int]]:
        """Replica -> (pool blocks, host-tier blocks) of the leading blocks of `block_hashes`
        it holds in either (those holding any): what its engine finds without computing."""
        replicas = {r for h in block_hashes[:1] for r in self._holders.get(h, ())}
        replicas |= {r for h in block_hashes[:1] for r in self._host_holders.get(h, ())}
        counts = {}
        for replica in replicas:
            pool = host = 0
            for block_hash in block_hashes:
                if replica in self._holders.get(block_hash, ()):
                    pool += 1
                elif replica in self._host_holders.get(block_hash, ()):
                    host += 1
                else:
                    break
            counts[replica] = (pool, host)
        return counts


class RoutingPolicy(Protocol):
    name: str

    def choose(
        self,
        candidates: Sequence[int],
        block_hashes: Sequence[bytes],
        index: PrefixIndex,
        loads: Mapping[int, ReplicaLoad],
    ) -> Decision: ...


@dataclass
class RoundRobin:
    name: str = "round_robin"
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def next_of(self, candidates: Sequence[int]) -> int:
        return candidates[next(self._turn) % len(candidates)]

    def choose(
        self,
        candidates: Sequence[int],
        block_hashes: Sequence[bytes],
        index: PrefixIndex,
        loads: Mapping[int, ReplicaLoad],
    ) -> Decision:
        return Decision(self.next_of(candidates), 0, "its turn")


def _load(loads: Mapping[int, ReplicaLoad], replica: int) -> float:
    return loads.get(replica, ReplicaLoad()).requests


def _adapter_first(replicas: list[int], loads: Mapping[int, ReplicaLoad]) -> list[int]:
    """Those of `replicas` where the request's adapter is resident, if any; else all."""
    return [r for r in replicas if loads.get(r, ReplicaLoad()).adapter_resident] or replicas


def _adapter_note(replica: int, loads: Mapping[int, ReplicaLoad]) -> str:
    return (
        ", its LoRA adapter resident" if loads.get(replica, ReplicaLoad()).adapter_resident else ""
    )


def _settled(
    candidates: Sequence[int], loads: Mapping[int, ReplicaLoad]
) -> Mapping[int, ReplicaLoad]:
    """`loads` whose timings compare: a replica that has not run SETTLED_STEPS steps is timed
    at the scale of the candidate that ran the most, which has (the replicas of one gateway
    serve one model)."""
    reference = max((loads[r] for r in candidates), key=lambda load: load.measured_steps)
    if not reference.prefill_token_seconds:
        return loads
    return {
        r: load.timed_like(reference)
        if load.measured_steps < SETTLED_STEPS and load.prefill_token_seconds
        else load
        for r, load in loads.items()
    }


@dataclass
class LeastLoad:
    name: str = "least_load"
    _turns: RoundRobin = field(default_factory=RoundRobin)

    def choose(
        self,
        candidates: Sequence[int],
        block_hashes: Sequence[bytes],
        index: PrefixIndex,
        loads: Mapping[int, ReplicaLoad],
    ) -> Decision:
        least = min(_load(loads, r) for r in candidates)
        lightest = [r for r in candidates if _load(loads, r) == least]
        return Decision(self._turns.next_of(lightest), 0, f"least loaded ({least:g} requests)")


@dataclass
class CacheAware:
    name: str = "cache_aware"
    balance_abs: float = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    min_match_share: float = MIN_MATCH_SHARE
    _least_load: LeastLoad = field(default_factory=LeastLoad)

    def choose(
        self,
        candidates: Sequence[int],
        block_hashes: Sequence[bytes],
        index: PrefixIndex,
        loads: Mapping[int, ReplicaLoad],
    ) -> Decision:
        known = [loads.get(r, ReplicaLoad()) for r in candidates]
        if all(load.timed for load in known) and any(
            load.measured_steps >= SETTLED_STEPS for load in known
        ):
            return self._soonest(candidates, block_hashes, index, loads)
        return self._by_counts(candidates, block_hashes, index, loads)

    def _soonest(
        self,
        candidates: Sequence[int],
        block_hashes: Sequence[bytes],
        index: PrefixIndex,
        loads: Mapping[int, ReplicaLoad],
    ) -> Decision:
        loads = _settled(candidates, loads)
        held = index.match_tiers(block_hashes)

        def new_tokens(replica: int) -> int:
            # Full blocks only: a prompt's partial last block is computed everywhere alike.
            pool, host = held.get(replica, (0, 0))
            cost = len(block_hashes) - pool - host + host * HOST_BLOCK_COST
            return math.ceil(cost * loads[replica].block_size)

        fitting = [r for r in candidates if loads[r].fits(new_tokens(r))]
        usable = fitting or list(candidates)
        expected = {r: loads[r].expected_ttft(new_tokens(r)) for r in usable}
        soonest = min(usable, key=expected.__getitem__)
        best = expected[soonest]
        # Within a step (the soonest replica's) of the best is a tie: then the cache decides,
        # then the load.
        near = [r for r in usable if expected[r] <= best + loads[soonest].decode_step_seconds]
        most = max(held.get(r, (0, 0)) for r in near)  # pool blocks first, then host ones
        holders = _adapter_first([r for r in near if held.get(r, (0, 0)) == most], loads)
        decision = self._least_load.choose(holders, block_hashes, index, loads)
        skipped = len(candidates) - len(fitting)
        note = f"; {skipped} without KV room skipped" if fitting and skipped else ""
        pool, host = most
        tier = f" (and {host} in its host tier)" if host else ""
        return Decision(
            decision.replica,
            pool + host,
            f"first token expected in {expected[decision.replica] * 1e3:.0f} ms (best "
            f"{best * 1e3:.0f} ms), holds {pool}/{len(block_hashes)} leading blocks{tier}"
            f"{_adapter_note(decision.replica, loads)}, {decision.reason}{note}",
        )

    def _by_counts(
        self,
        candidates: Sequence[int],
        block_hashes: Sequence[bytes],
        index: PrefixIndex,
        loads: Mapping[int, ReplicaLoad],
    ) -> Decision:
        mean = sum(_load(loads, r) for r in candidates) / len(candidates)
        threshold = max(self.balance_abs, self.balance_rel * mean)
        usable = [r for r in candidates if _load(loads, r) <= threshold] or list(candidates)
        skipped = len(candidates) - len(usable)
        note = f"; {skipped} over the load threshold {threshold:g} skipped" if skipped else ""
        held = index.match_tiers(block_hashes)

        def saved(replica: int) -> float:
            """The blocks of prefill a replica saves: a host tier's at 1 - HOST_BLOCK_COST."""
            pool, host = held.get(replica, (0, 0))
            return pool + host * (1 - HOST_BLOCK_COST)

        best = max((saved(r) for r in usable), default=0.0)
        if block_hashes and best >= max(1, self.min_match_share * len(block_hashes)):
            holders = _adapter_first([r for r in usable if saved(r) == best], loads)
            decision = self._least_load.choose(holders, block_hashes, index, loads)
            pool, host = held[decision.replica]
            tier = f" (and {host} in its host tier)" if host else ""
            return Decision(
                decision.replica,
                pool + host,
                f"holds {pool}/{len(block_hashes)} leading blocks{tier}"
                f"{_adapter_note(decision.replica, loads)}, {decision.reason}{note}",
            )
        decision = self._least_load.choose(
            _adapter_first(usable, loads), block_hashes, index, loads
        )
        return Decision(
            decision.replica,
            sum(held.get(decision.replica, (0, 0))),
            f"no replica holds enough of the prompt ({best:g}/{len(block_hashes)} blocks)"
            f"{_adapter_note(decision.replica, loads)}, {decision.reason}{note}",
        )


def make_policy(name: str) -> RoutingPolicy:
    policies: dict[str, type[RoundRobin] | type[LeastLoad] | type[CacheAware]] = {
        "round_robin": RoundRobin,
        "least_load": LeastLoad,
        "cache_aware": CacheAware,
    }
    if name not in policies:
        raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {name!r}")
    return policies[name]()
