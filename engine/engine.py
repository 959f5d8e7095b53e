"""The engine loop: validate and admit requests, then `step()` = schedule, execute, update.

One loop for every executor (engine.executor): the model executor (the default) runs each step
on the model, the simulated one (engine.simulated) models its time. Admission, scheduling
(engine.core), the update after a step (computed tokens, prefix-cache blocks, stop conditions,
outputs) and the KV events are this module's alone; running the step and choosing tokens are
the executor's. Token ids in, token ids out: this module never sees text, HTTP or gRPC, and
never imports torch (the model executor is imported only when built). It is not thread-safe;
one caller drives it (the offline API or the engine service's loop thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from common.config import EngineConfig, default_step_cost_path
from common.finish_reason import FinishReason
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from common.service_level import NO_SERVICE_LEVEL, ServiceLevel
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_events import KVEventPublisher
from engine.core.outputs import (
    NO_TOKEN,
    EngineStats,
    Logprobs,
    RequestOutput,
    SamplerOutput,
    StepTimings,
)
from engine.core.request import Request, check_new_request, ended_output
from engine.core.scheduler import Scheduler
from engine.core.step_cost import LiveStepCost, StepCostModel
from engine.core.stopping import check_stop
from engine.errors import EngineGroupError, InvalidRequestError
from engine.executor import Executor
from engine.kv_tiers.pins import MAX_PIN_TTL_SECONDS
from engine.lora.registry import LoraRegistry, find_adapter, runtime_lora
from engine.spec_decode.drafter import Drafter

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        step_cost: StepCostModel | None = None,
    ) -> None:
        """executor: what runs the steps; None = the model executor on config's model.
        step_cost: what its steps are expected to cost, before measured steps rescale it (for
        deadline admission); None = the profile `folio bench profile` wrote, if any."""
        self.config = config
        if executor is None:
            # Imported here: it loads torch and the model code, which an engine on another
            # executor (the simulated one) must not pay for.
            from engine.model_executor import ModelExecutor

            executor = ModelExecutor(config)
        self.executor: Executor = executor
        self.model_path: Path = executor.model_path
        self.vocab_size = executor.vocab_size
        self.eos_token_ids = executor.eos_token_ids
        self.max_model_len = executor.max_model_len
        self.kv_cache = KVCacheManager(
            executor.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            executor.kv_groups.windows,
            executor.kv_tier_book,
        )
        # What the prefix cache stores and evicts, numbered per step for subscribers (routers).
        self.kv_events = KVEventPublisher(config.kv_events_replay_batches)
        self.step_cost = LiveStepCost(
            step_cost or StepCostModel.load_or_default(default_step_cost_path())
        )
        self.scheduler = Scheduler(config, self.kv_cache, self.step_cost)
        # LoRA adapters (engine.lora.registry): start-up's, then those loaded at run time; a
        # request runs once its adapter has one of the model's slots.
        self.lora = LoraRegistry.start(config, executor.lora_backend)
        if self.lora is not None:
            self.scheduler.admission_gate = self.lora.pin
        # Speculative decoding: what drafts tokens before each step (engine.spec_decode).
        spec = config.speculative
        self.drafter = (
            Drafter(
                spec,
                self.max_model_len,
                self.step_cost,
                executor.draft_proposer,
                executor.grammar_allows,
                executor.max_invariant_rows,
            )
            if spec
            else None
        )
        self.requests: dict[str, Request] = {}
        # Requests with a total deadline, checked before every step.
        self._deadlines: dict[str, Request] = {}
        self.timings = StepTimings()
        # When the last step ended with work left: the time until the next one starts (adding
        # requests, handing out outputs) delays waiting requests as much as the step itself.
        self._busy_since: float | None = None
        self._left_waiting = 0

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        service: ServiceLevel = NO_SERVICE_LEVEL,
        lora_name: str | None = None,
        pin_ttl_seconds: float = 0.0,
        pin_owner: str = "",
        pin_owner_max_bytes: int | None = None,
    ) -> Request:
        """Validate and queue a request; raises InvalidRequestError or QueueFullError. With
        params.n > 1 its samples are registered too (ids from sample_request_id): the prompt is
        computed once, then each sample reports under request_id with its index. With `pooling`
        it is an embedding request: `params` are ignored, its prompt is computed once and its
        one output carries the pooled vector (RequestOutput.embedding). With pin_ttl_seconds
        > 0 its prompt's full blocks are pinned in the KV cache that long (engine.kv_tiers.pins),
        as `pin_owner`'s pins, of which at most pin_owner_max_bytes (of KV) at once."""
        if not 0 <= pin_ttl_seconds <= MAX_PIN_TTL_SECONDS:
            raise InvalidRequestError(
                f"pin_ttl_seconds must be within [0, {MAX_PIN_TTL_SECONDS}], got {pin_ttl_seconds}"
            )
        if pin_owner_max_bytes is not None and pin_owner_max_bytes < 0:
            raise InvalidRequestError(
                f"pin_owner_max_bytes must be >= 0, got {pin_owner_max_bytes}"
            )
        if pooling is not None:
            params = SamplingParams()
        check_new_request(
            request_id,
            prompt_token_ids,
            params,
            priority,
            ids_in_use=self.requests,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            validate_params=self.executor.validate_params,
            service=service,
            pooling=pooling,
        )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n is {params.n}, but this engine runs at most {self.config.max_num_seqs} "
                "sequences at once (max_num_seqs), and a request's samples run side by side"
            )
        adapter = find_adapter(self.lora, lora_name)  # ModelNotFound (404) if not served
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            priority=priority,
            service=service,
            pooling=pooling,
            pin_ttl_seconds=pin_ttl_seconds,
            pin_owner=pin_owner,
            pin_owner_max_blocks=(
                None
                if pin_owner_max_bytes is None
                else pin_owner_max_bytes // self.executor.kv_block_bytes
            ),
        )
        if any(sample.request_id in self.requests for sample in request.samples):
            raise InvalidRequestError(
                f"request_id {request_id!r}: the ids of its samples ({request_id}#<index>) are "
                "already in use"
            )
        if adapter is not None:
            LoraRegistry.label(request, adapter)
        self.executor.join(request)
        self.scheduler.add_request(request)
        if self.lora is not None:
            self.lora.hold(request)
        self.requests[request_id] = request
        for sample in request.samples:
            self.requests[sample.request_id] = sample
        if service.total_ms is not None:
            self._deadlines[request_id] = request
        return request

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request and free its KV blocks. Returns its last outputs (finish reason
        ABORT): one, or one per live sample of an n > 1 request; a sample's own id
        (sample_request_id) stops that sample alone. Empty if unknown or already done."""
        return self._end(request_id, FinishReason.ABORT)

    def _end(self, request_id: str, reason: FinishReason) -> list[RequestOutput]:
        request = self.requests.get(request_id)
        if request is None:
            return []
        ended = list(request.samples) or [request]
        for r in ended:
            r.finish_reason = reason
            self._retire(r)
        return [ended_output(r, reason) for r in ended]

    def _retire(self, request: Request) -> None:
        """Drop a finished or aborted request from the engine and free its KV blocks; the
        last live sample of an n > 1 request takes that request with it."""
        self.scheduler.finish(request)
        self.executor.leave(request)
        if self.drafter is not None:
            self.drafter.finished(request)
        if self.lora is not None:
            self.lora.leave(request)
        del self.requests[request.request_id]
        self._deadlines.pop(request.request_id, None)
        parent = request.parent
        if parent is not None:
            parent.samples.remove(request)
            if not parent.samples:
                self._retire(parent)

    def read_lora_adapter(self, name: str, path: str) -> tuple[str, object]:
        """Check and read the PEFT adapter at `path` for load_lora_adapter, from any thread
        (nothing changes until that serves it); InvalidRequestError naming what is refused."""
        registry = runtime_lora(self.lora, self.config)
        return registry.runtime_read(name, path, self.config.lora_root)

    def load_lora_adapter(
        self, name: str, path: str, read: tuple[str, object] | None = None
    ) -> None:
        """Serve the PEFT adapter at `path` as `name` from now on (run time: `path` must resolve
        inside --lora-root), read now unless `read` is read_lora_adapter's answer;
        InvalidRequestError naming what is refused."""
        registry = runtime_lora(self.lora, self.config)
        registry.runtime_add(name, read or registry.runtime_read(name, path, self.config.lora_root))

    def unload_lora_adapter(self, name: str, on_gone: Callable[[], None] | None = None) -> None:
        """New requests for `name` get ModelNotFound at once; it is freed (`on_gone` runs) once
        its requests ended. NotFound if no adapter of that name is served."""
        runtime_lora(self.lora, self.config).runtime_remove(name, on_gone)

    def close(self) -> None:
        """Stop the executor's tensor-parallel workers, if any (idempotent); the engine is
        unusable after."""
        self.executor.close()

    def add_failure_listener(self, listener: Callable[[EngineGroupError], None]) -> None:
        """`listener(EngineGroupError)` runs (in another thread) if a tensor-parallel rank dies
        or hangs; single-process engines never call it."""
        self.executor.add_failure_listener(listener)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def dtype_name(self) -> str:
        """The weights' and activations' dtype, e.g. "float32" ("simulated" without a model)."""
        return self.executor.dtype_name

    @property
    def kv_cache_dtype_name(self) -> str:
        """The KV pool's dtype, e.g. "bfloat16"."""
        return self.executor.kv_cache_dtype_name

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        if self.drafter is not None:
            spec = self.drafter.stats
            stats.spec_num_drafts = spec.num_drafts
            stats.spec_num_draft_tokens = spec.num_draft_tokens
            stats.spec_num_accepted_tokens = spec.num_accepted_tokens
        if self.kv_cache.tiers is not None:
            stats.kv_tier_hits, stats.kv_tier_usage = self.kv_cache.tiers.report()
        stats.kv_pinned_blocks = self.kv_cache.num_pinned
        if self.lora is not None:
            self.lora.report(stats, self.scheduler.running, self.scheduler.waiting)
        return stats

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._end_overdue()
        outputs += self._step()
        if self.kv_cache.tiers is not None:
            self.kv_cache.tiers.flush()  # the blocks this step cached, to disk
        self.kv_events.publish(self.kv_cache.take_kv_events())
        return outputs

    def _end_overdue(self) -> list[RequestOutput]:
        """End the requests past their total deadline (FinishReason.DEADLINE): whatever they
        would still compute, their callers no longer wait for."""
        if not self._deadlines:
            return []
        now = time.monotonic()
        overdue = [rid for rid, r in self._deadlines.items() if r.total_deadline <= now]
        return [output for rid in overdue for output in self._end(rid, FinishReason.DEADLINE)]

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        between = 0.0 if self._busy_since is None else t0 - self._busy_since
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running, self._left_waiting)
        sched = self.scheduler.schedule()
        # Requests the last step left waiting for a place (not those that just arrived, which
        # a batch with room takes at once): what drafting's worth depends on (engine.spec_decode).
        self._left_waiting = len(self.scheduler.waiting)
        if self.lora is not None:
            for preempted in sched.preempted:
                self.lora.unpin(preempted)
        t1 = time.perf_counter()
        if sched.is_empty:
            self._busy_since = None
            return []
        executed = self.executor.execute(sched, t0)
        t2 = time.perf_counter()
        outputs = self._update(
            sched.requests, sched.num_new_tokens, sched.sampling_requests, executed.sampled
        )
        outputs += self._pooled(sched.pooling_requests, executed.embeddings)
        t3 = time.perf_counter()
        num_decodes = sched.num_decodes
        self.step_cost.observe(sched.total_tokens - num_decodes, num_decodes, t3 - t0 + between)
        plan = sched.plan
        if self.drafter is not None and sched.total_tokens == plan.num_scheduled + len(
            plan.spec_token_ids
        ):  # a step of decodes and drafts only: what drafting changes
            self.drafter.observe_step(bool(plan.spec_token_ids), plan.num_scheduled, t3 - t0)
        self._busy_since = t3 if self.scheduler.has_unfinished else None
        self.timings.add(
            t1 - t0,
            executed.prepare_seconds,
            executed.forward_seconds,
            executed.sample_seconds,
            t3 - t2,
        )
        if executed.modelled_seconds is not None:
            self.timings.add_overrun(t3 - t0 - executed.modelled_seconds)
        return outputs

    def _update(
        self,
        scheduled: list[Request],
        num_new_tokens: list[int],
        sampling_requests: list[Request],
        sampled: SamplerOutput,
    ) -> list[RequestOutput]:
        accepted = sampled.accepted
        for request, num_new in zip(scheduled, num_new_tokens, strict=False):
            request.num_computed_tokens += num_new
            if request.spec_token_ids:
                continue  # its drafts are settled (and its blocks cached) with its tokens below
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            if request.samples and request.num_computed_tokens == request.num_tokens:
                # n > 1: the prompt is computed; its samples (the sampling rows) take over.
                self.scheduler.fork(request)
        now = time.monotonic()
        outputs = []
        for row, request in enumerate(sampling_requests):
            reason: FinishReason | None
            if request.sampling_params.max_tokens == 0:
                # Scoring only: the prompt is computed (for its logprobs), nothing generated.
                new_token_ids, new_logprobs, reason = [], [], FinishReason.LENGTH
            else:
                # Speculative decoding: the drafts verification accepted come first.
                new_token_ids = (
                    [*accepted[row], sampled.token_ids[row]]
                    if accepted
                    else [sampled.token_ids[row]]
                )
                last = sampled.logprobs[row]
                new_logprobs = (
                    [] if last is None else [*self._accepted_logprobs(sampled, row), last]
                )
                drafted = bool(request.spec_token_ids)
                if drafted:
                    self._settle_drafts(request, len(accepted[row]) if accepted else 0)
                reason = None
                for count, token_id in enumerate(new_token_ids, 1):
                    if token_id == NO_TOKEN:
                        logger.warning(
                            "request %s ends: its allowed_token_ids or bad_words, with its "
                            "structured output, leave no token to choose",
                            request.caller_id,
                        )
                        reason = FinishReason.STOP
                        del new_token_ids[count - 1 :]
                        del new_logprobs[count - 1 :]
                        break
                    request.append_output(token_id)
                    reason = check_stop(request, self.eos_token_ids, self.max_model_len)
                    # Asked even when the request stops anyway: the executor's constraint
                    # follows every output token.
                    if self.executor.constraint_ended(request) and reason is None:
                        reason = FinishReason.STOP  # the grammar is complete
                    if reason is not None:
                        del new_token_ids[count:]  # tokens past a stop are not the request's
                        del new_logprobs[count:]
                        break
                request.output_logprobs += new_logprobs
                if drafted:
                    # As without drafts: the blocks of its tokens but the newest are cached.
                    self.kv_cache.cache_blocks(
                        request, min(request.num_computed_tokens, request.num_tokens - 1)
                    )
                    self.scheduler.roll_back(request)
            if request.times.first_token is None:
                request.times.first_token = now
            if reason is not None:
                request.finish_reason = reason
                request.times.finished = now
                self._retire(request)
            outputs.append(
                RequestOutput(
                    request_id=request.caller_id,
                    index=request.sample_index,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    prompt_logprobs=self._first_output_prompt_logprobs(request),
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=request.num_output_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_seconds=_queue_seconds(request) if reason is not None else 0.0,
                    num_draft_tokens=request.num_drafted_tokens,
                    num_accepted_tokens=request.num_accepted_tokens,
                )
            )
        return outputs

    def _settle_drafts(self, request: Request, num_accepted: int) -> None:
        """A request's drafts are verified: its computed tokens count the accepted ones only
        (the rejected ones' KV slots are written over later; their blocks go back in
        roll_back), and the drafter learns its acceptance."""
        assert self.drafter is not None, "drafts without a drafter"
        num_drafted = len(request.spec_token_ids)
        request.num_computed_tokens -= num_drafted - num_accepted
        request.spec_token_ids = []
        self.drafter.settle(request, num_drafted, num_accepted)

    @staticmethod
    def _accepted_logprobs(sampled: SamplerOutput, row: int) -> list[Logprobs]:
        return sampled.accepted_logprobs[row] if sampled.accepted_logprobs else []

    def _pooled(
        self, requests: list[Request], embeddings: list[list[float]]
    ) -> list[RequestOutput]:
        """The embedding requests whose prompt the step completed end with their vector; their
        KV blocks are freed at once."""
        now = time.monotonic()
        outputs = []
        for request, embedding in zip(requests, embeddings, strict=True):
            request.finish_reason = FinishReason.STOP
            request.times.first_token = request.times.finished = now
            self._retire(request)
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finished=True,
                    finish_reason=FinishReason.STOP,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=0,
                    queue_seconds=_queue_seconds(request),
                    embedding=embedding,
                )
            )
        return outputs

    @staticmethod
    def _first_output_prompt_logprobs(
        request: Request,
    ) -> list[tuple[int, float, list[tuple[int, float]]]] | None:
        """The prompt logprobs with their token ids, on the request's (each sample's) first
        output only."""
        if request.sampling_params.prompt_logprobs is None or request.num_output_tokens > 1:
            return None
        records = (request.parent or request).prompt_logprobs
        return [
            (token_id, logprob, top)
            for token_id, (logprob, top) in zip(request.prompt_token_ids[1:], records, strict=False)
        ]


def _queue_seconds(request: Request) -> float:
    """Seconds from arrival to first being scheduled, of a request that has been scheduled."""
    first_scheduled = request.times.first_scheduled
    if first_scheduled is None:
        raise ValueError(f"request {request.request_id!r} has not been scheduled")
    return first_scheduled - request.times.arrival
