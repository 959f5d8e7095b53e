"""The gateway's engine replicas: one session per replica (its Generate stream and output
processor, gateway/engines/session.py), their health, their load and what their prefix caches
hold, and where each request goes.

With one replica every request goes to it, as before replicas existed. With several, a monitor
per replica polls its load (GetStats) while it is healthy and its health while it is not: a
replica whose stream broke or that stopped answering leaves the rotation until it reports
SERVING again. A follower per replica reads its KV events (Engine.SubscribeKvEvents) into the
prefix index, resuming after a break from the last batch it applied (the engine replays the
gap, or sends a snapshot), and forgets the replica's blocks when its epoch changes. Requests go
where the routing policy (gateway/engines/routing.py) says; a request whose replica dies before its
first token runs once more on another replica. Placement, health and bookkeeping only: it never
parses a request and never turns tokens into text.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from common.block_hash import prefix_block_hashes
from common.errors import FolioError, UnavailableError
from common.sampling_params import SamplingParams
from gateway.engines.clients import EngineClient
from gateway.engines.lora import current_lora
from gateway.engines.routing import Decision, PrefixIndex, ReplicaLoad, RoutingPolicy
from gateway.engines.session import ReplicaSession
from gateway.messages import EngineModel, EngineStats, KvEventBatch, StepOutput
from gateway.metrics import Metrics
from gateway.pipeline.output_processor import TrackedRequest

logger = logging.getLogger(__name__)

# How often a healthy replica's load is polled, and an unhealthy one's health.
MONITOR_SECONDS = 0.25
# How long a broken KV event stream waits before it subscribes again.
RESUBSCRIBE_SECONDS = 0.5
# A request runs on at most this many replicas (the first, and one retry).
MAX_ATTEMPTS = 2


@dataclass(eq=False)
class Replica:
    index: int
    client: EngineClient  # its unary calls: stats, health, model info, KV events
    session: ReplicaSession = field(init=False)  # its requests
    healthy: bool = True
    in_flight: int = 0  # requests placed here that have not been released
    stats: EngineStats | None = None  # its latest GetStats answer
    placed_since_stats: int = 0  # requests placed here since `stats` came
    # Of those, the ones without a first output yet: request id -> the prompt tokens the
    # replica has to compute for it (those its prefix cache holds not counted). Its first
    # output says its prefill is done: counted until then, its tokens would make a replica
    # that serves a conversation's turns look busy for a whole poll after it computed them.
    prefilling: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """Its label in metrics and logs."""
        return self.client.address

    @property
    def tokens_since_stats(self) -> int:
        return sum(self.prefilling.values())

    def load(self, token_budget: int, lora_name: str | None = None) -> ReplicaLoad:
        """What the engine reports, not this gateway's own in-flight count: the workers of a
        gateway, and several gateways, then weigh the replica alike. `token_budget`: its
        max_num_batched_tokens (0: unknown); `lora_name`: the request's adapter (None: the
        base model), resident there or not as its last answer said."""
        stats = self.stats
        if stats is None:
            return ReplicaLoad(self.placed_since_stats, unreported_tokens=self.tokens_since_stats)
        return ReplicaLoad(
            self.placed_since_stats,
            stats.num_running,
            stats.num_waiting,
            stats.kv_cache_usage,
            unreported_tokens=self.tokens_since_stats,
            queued_prefill_tokens=stats.queued_prefill_tokens,
            prefill_token_seconds=stats.prefill_token_seconds,
            decode_step_seconds=stats.decode_step_seconds,
            num_kv_blocks=stats.num_kv_blocks,
            block_size=stats.block_size,
            token_budget=token_budget,
            measured_steps=stats.num_steps,
            adapter_resident=lora_name is not None and lora_name in stats.resident_lora_adapters,
        )

    def reported(self, stats: EngineStats | None) -> None:
        """The engine's latest answer (None: none to trust); it counts what was placed so far."""
        self.stats = stats
        self.placed_since_stats = 0
        self.prefilling.clear()

    def progressed(self, outputs: Sequence[StepOutput]) -> None:
        """A step's outputs from this replica: their requests' prefills are done."""
        if self.prefilling:
            for output in outputs:
                self.prefilling.pop(output.request_id, None)


@dataclass(eq=False)
class _Placement:
    replica: Replica
    params: SamplingParams
    priority: int
    attempts: int = 1
    tried: set[int] = field(default_factory=set)


def pool_lora_stats(total: EngineStats, answer: EngineStats) -> None:
    """One replica's LoRA adapters into the pool's: each adapter once among the running,
    waiting and resident ones, the slots and requests per adapter summed."""
    for names, more in (
        (total.running_lora_adapters, answer.running_lora_adapters),
        (total.waiting_lora_adapters, answer.waiting_lora_adapters),
        (total.resident_lora_adapters, answer.resident_lora_adapters),
    ):
        names.extend(name for name in more if name not in names)
    total.max_lora += answer.max_lora
    for name, count in answer.lora_requests.items():
        total.lora_requests[name] = total.lora_requests.get(name, 0) + count


class EnginePool:
    def __init__(
        self,
        clients: Sequence[EngineClient],
        policy: RoutingPolicy,
        metrics: Metrics,
    ) -> None:
        """`metrics`: where the replicas' requests routed, health and indexed blocks count (and
        the request-level series their processors observe)."""
        if not clients:
            raise ValueError("at least one engine address is needed")
        self.replicas = [Replica(i, client) for i, client in enumerate(clients)]
        self.policy = policy
        self.index = PrefixIndex()
        self._metrics = metrics
        for replica in self.replicas:
            replica.session = ReplicaSession(
                replica.client,
                metrics,
                retry=functools.partial(self._retry, failed=replica),
                on_broken=functools.partial(self._lost, replica, "its Generate stream broke"),
                on_outputs=replica.progressed,
            )
            metrics.replica_routed.labels(replica.name)  # 0 until its first request
            self._set_healthy(replica, True)
            self._count_blocks(replica)
        self._placements: dict[TrackedRequest, _Placement] = {}
        self._block_size: int | None = None  # from the engines' model info
        self._token_budget = 0  # their max_num_batched_tokens, from the same
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    @property
    def several(self) -> bool:
        return len(self.replicas) > 1

    def start(self) -> None:
        """Start the monitors and KV event followers (with several replicas; in a running loop)."""
        if not self.several:
            return
        for replica in self.replicas:
            self._tasks.append(asyncio.create_task(self._monitor(replica)))
            if self.policy.name == "cache_aware":
                self._tasks.append(asyncio.create_task(self._follow_kv_events(replica)))

    # -- what the gateway asks of "the engine" ----------------------------------------------------

    @property
    def broken_streams(self) -> int:
        return sum(r.session.broken_streams for r in self.replicas)

    async def serving(self) -> bool:
        """Whether a replica serves."""
        answers = await asyncio.gather(*(r.client.serving() for r in self.replicas))
        return any(answers)

    async def model_info(self) -> EngineModel:
        """The served model, from the first replica in rotation that answers."""
        error: FolioError = UnavailableError("engine: no replica is serving")
        for replica in self._in_rotation():
            try:
                info = await replica.client.model_info()
            except FolioError as exc:
                error = exc
                continue
            self._block_size = info.block_size
            self._token_budget = info.max_num_batched_tokens
            return info
        raise error

    async def lora_adapters(self) -> dict[str, bool]:
        """The LoRA adapters the replicas in rotation serve (each: resident on any of them)."""
        answers = await asyncio.gather(*(r.client.lora_adapters() for r in self._in_rotation()))
        served: dict[str, bool] = {}
        for answer in answers:
            for name, resident in answer.items():
                served[name] = served.get(name, False) or resident
        return served

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load it on every replica in rotation (the first refusal is raised)."""
        await asyncio.gather(*(r.client.load_lora_adapter(name, path) for r in self._in_rotation()))

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload it on every replica in rotation; returns once its requests ended on all."""
        await asyncio.gather(*(r.client.unload_lora_adapter(name) for r in self._in_rotation()))

    async def stats(self) -> EngineStats:
        """Every replica's stats (kept for the per-replica series), and their sum for the
        engine-wide ones; raises when no replica answers."""
        answers = await asyncio.gather(
            *(r.client.stats() for r in self.replicas), return_exceptions=True
        )
        total = EngineStats()
        usage_blocks = 0.0
        tier_usage: dict[str, list[float]] = {}
        error: BaseException | None = None
        for replica, answer in zip(self.replicas, answers, strict=True):
            if isinstance(answer, BaseException):
                error = answer
                replica.reported(None)  # its last answer no longer holds
                continue
            replica.reported(answer)
            total.num_running += answer.num_running
            total.num_waiting += answer.num_waiting
            total.num_kv_blocks += answer.num_kv_blocks
            # The replicas of one gateway share their pools' layout.
            total.block_size = answer.block_size
            total.kv_cache_dtype = answer.kv_cache_dtype
            usage_blocks += answer.kv_cache_usage * answer.num_kv_blocks
            total.prefix_cache_queries += answer.prefix_cache_queries
            total.prefix_cache_hits += answer.prefix_cache_hits
            total.num_preemptions += answer.num_preemptions
            total.spec_num_drafts += answer.spec_num_drafts
            total.spec_num_draft_tokens += answer.spec_num_draft_tokens
            total.spec_num_accepted_tokens += answer.spec_num_accepted_tokens
            total.num_steps += answer.num_steps
            for phase, seconds in answer.step_seconds.items():
                total.step_seconds[phase] = total.step_seconds.get(phase, 0.0) + seconds
            for tier, tokens in answer.kv_tier_hits.items():
                total.kv_tier_hits[tier] = total.kv_tier_hits.get(tier, 0) + tokens
            for tier, share in answer.kv_tier_usage.items():
                tier_usage.setdefault(tier, []).append(share)
            total.kv_pinned_blocks += answer.kv_pinned_blocks
            pool_lora_stats(total, answer)
        if all(isinstance(a, BaseException) for a in answers):
            assert error is not None
            raise error
        if total.num_kv_blocks:
            total.kv_cache_usage = usage_blocks / total.num_kv_blocks
        total.kv_tier_usage = {tier: sum(s) / len(s) for tier, s in tier_usage.items()}
        return total

    # -- placing requests -----------------------------------------------------------------------

    def submit(self, request: TrackedRequest, params: SamplingParams, priority: int) -> None:
        """Send a request to the replica the policy picks."""
        placement = _Placement(self.replicas[0], params, priority)
        self._place(request, placement, self._in_rotation())

    def release(self, requests: Sequence[TrackedRequest]) -> None:
        """The callers are done with these requests: abort what still runs, forget them."""
        for request in requests:
            placement = self._placements.pop(request, None)
            if placement is None:
                continue
            placement.replica.in_flight -= 1
            # Ended or aborted before any output (no poll clears it with one replica).
            placement.replica.prefilling.pop(request.request_id, None)
            placement.replica.session.release([request])

    def _in_rotation(self, excluding: set[int] | None = None) -> list[Replica]:
        """Healthy replicas (all of them if none is: their errors then say why)."""
        excluded = excluding or set()
        healthy = [r for r in self.replicas if r.healthy and r.index not in excluded]
        return healthy or [r for r in self.replicas if r.index not in excluded]

    def _place(
        self, request: TrackedRequest, placement: _Placement, candidates: list[Replica]
    ) -> None:
        replica, matched_blocks = self._choose(request, candidates)
        placement.replica = replica
        placement.tried.add(replica.index)
        self._placements[request] = placement
        replica.in_flight += 1
        replica.placed_since_stats += 1
        # What it will compute: the prompt less the leading blocks it was found to hold.
        cached = matched_blocks * (self._block_size or 0)
        replica.prefilling[request.request_id] = max(0, len(request.text.prompt_ids) - cached)
        self._metrics.replica_routed.labels(replica.name).inc()
        replica.session.submit(request, placement.params, placement.priority)

    def _choose(self, request: TrackedRequest, candidates: list[Replica]) -> tuple[Replica, int]:
        """The replica for `request`, and how many leading blocks of its prompt it holds."""
        if len(candidates) == 1:
            return candidates[0], 0
        hashes = (
            prefix_block_hashes(request.text.prompt_ids, self._block_size)
            if self._block_size and self.policy.name == "cache_aware"
            else []
        )
        decision: Decision = self.policy.choose(
            [r.index for r in candidates],
            hashes,
            self.index,
            {r.index: r.load(self._token_budget, current_lora()) for r in candidates},
        )
        chosen = self.replicas[decision.replica]
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s -> replica %s (%s): %s",
                request.request_id,
                decision.replica,
                chosen.name,
                decision.reason,
            )
        return chosen, decision.matched_blocks

    def _retry(self, request: TrackedRequest, failed: Replica) -> bool:
        """A request the failed replica lost before its first token: once more elsewhere."""
        placement = self._placements.get(request)
        if self._closing or placement is None or placement.replica is not failed:
            return False
        others = [r for r in self._in_rotation(placement.tried) if r.healthy and r is not failed]
        if placement.attempts >= MAX_ATTEMPTS or not others:
            return False
        failed.in_flight -= 1
        failed.prefilling.pop(request.request_id, None)
        placement.attempts += 1
        logger.info(
            "replica %s was lost before request %s started: retrying it elsewhere",
            failed.name,
            request.request_id,
        )
        self._place(request, placement, others)
        return True

    # -- health, load and KV events -------------------------------------------------------------

    def _set_healthy(self, replica: Replica, healthy: bool) -> None:
        replica.healthy = healthy
        self._metrics.replica_healthy.labels(replica.name).set(1.0 if healthy else 0.0)

    def _count_blocks(self, replica: Replica) -> None:
        blocks = self.index.num_blocks(replica.index)
        self._metrics.replica_indexed_blocks.labels(replica.name).set(blocks)

    def _lost(self, replica: Replica, why: str) -> None:
        if replica.healthy and self.several:
            logger.warning("engine replica %s out of rotation: %s", replica.name, why)
            self._set_healthy(replica, False)
            replica.reported(None)

    async def _monitor(self, replica: Replica) -> None:
        while True:
            if replica.healthy:
                try:
                    replica.reported(await replica.client.stats())
                except FolioError as exc:
                    self._lost(replica, str(exc))
            elif await replica.client.serving():
                logger.warning("engine replica %s back in rotation", replica.name)
                self._set_healthy(replica, True)
            await asyncio.sleep(MONITOR_SECONDS)

    async def _follow_kv_events(self, replica: Replica) -> None:
        epoch, next_number = "", 0
        while True:
            try:
                async for batch in replica.client.kv_events(next_number, epoch):
                    if batch.epoch != epoch:
                        self.index.clear(replica.index)  # another engine: forget the old one
                        epoch = batch.epoch
                    self._apply(replica.index, batch)
                    self._count_blocks(replica)
                    next_number = batch.sequence_number + 1
            except grpc.aio.AioRpcError as exc:
                logger.debug("KV events of replica %s: %s", replica.name, exc.code().name)
            await asyncio.sleep(RESUBSCRIBE_SECONDS)

    def _apply(self, replica: int, batch: KvEventBatch) -> None:
        for event in batch.events:
            if event.kind == "block_stored":
                self.index.stored(replica, event.block_hashes, event.medium)
            elif event.kind == "block_removed":
                self.index.removed(replica, event.block_hashes, event.medium)
            else:
                self.index.clear(replica)

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(r.session.close() for r in self.replicas))
        await asyncio.gather(*(r.client.close() for r in self.replicas))
