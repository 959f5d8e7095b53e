"""The engine loop: validate and admit requests, then `step()` = schedule, prepare inputs,
forward, sample, update.

Token ids in, token ids out: this module never sees text, HTTP or gRPC. It is not
thread-safe; one caller drives it (the offline API or the engine service's loop thread).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from common.config import EngineConfig
from common.default_model import resolve_model_path
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import KVCacheManager, num_blocks_for_budget
from engine.core.kv_events import KVEventPublisher
from engine.core.outputs import EngineStats, RequestOutput, StepTimings
from engine.core.prompt_logprobs import record_prompt_logprobs
from engine.core.request import Request, aborted_output, check_new_request
from engine.core.scheduler import Scheduler
from engine.core.stopping import check_stop
from engine.distributed import EngineGroup, start_engine_group
from engine.errors import InvalidRequestError
from engine.grammar import validate_sampling_params
from engine.model_runner import ModelRunner, resolve_dtype
from engine.models.config import ModelConfig
from engine.models.parallel import (
    SINGLE,
    TensorParallel,
    check_tensor_parallel_size,
    kv_heads_slice,
)
from engine.sampler import Sampler, SamplerOutput
from engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path: Path = resolve_model_path(config.model)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_config = ModelConfig.from_dir(self.model_path)
        self.model_config = model_config
        dtype = resolve_dtype(config.dtype, config.device, config.quantization)
        tp_size = config.tensor_parallel_size
        check_tensor_parallel_size(
            model_config.num_attention_heads, model_config.num_key_value_heads, tp_size
        )
        # The budget is per rank: each holds its share of the KV heads, all the same block ids.
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            config.kv_cache_memory_bytes,
            model_config.num_hidden_layers,
            kv_heads_slice(model_config.num_key_value_heads, TensorParallel(0, tp_size)).count,
            model_config.head_dim,
            config.block_size,
            torch.empty((), dtype=dtype).element_size(),
        )
        self.max_model_len = self._max_model_len(config, model_config, num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # What the prefix cache stores and evicts, numbered per step for subscribers (routers).
        self.kv_events = KVEventPublisher(config.kv_events_replay_batches)
        self.scheduler = Scheduler(config, self.kv_cache)
        self.group: EngineGroup | None = None
        if tp_size > 1:
            self.group = start_engine_group(config, self.model_path, num_blocks, self.max_model_len)
        try:
            self.runner = ModelRunner(
                config,
                str(self.model_path),
                num_blocks,
                self.max_model_len,
                self.group.tp if self.group else SINGLE,
            )
        except BaseException:
            self.close()
            raise
        if self.group is not None:
            self.runner.broadcast_plan = self.group.broadcast_plan
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.sampler = Sampler(
            model_config.vocab_size, sorted(self.eos_token_ids), config.device, config.seed
        )
        self.structured = StructuredOutputManager(
            self.model_path, model_config.vocab_size, sorted(self.eos_token_ids), config.device
        )
        self.requests: dict[str, Request] = {}
        self.timings = StepTimings()

    @staticmethod
    def _max_model_len(config: EngineConfig, model_config: ModelConfig, num_blocks: int) -> int:
        pool_tokens = num_blocks * config.block_size
        if config.max_model_len is not None:
            if config.max_model_len > pool_tokens:
                raise ValueError(
                    f"max_model_len ({config.max_model_len}) exceeds the KV cache capacity "
                    f"({pool_tokens} tokens = {num_blocks} blocks of {config.block_size}); "
                    "raise kv_cache_memory_bytes / num_kv_blocks or lower max_model_len"
                )
            return config.max_model_len
        limit = min(model_config.max_position_embeddings, pool_tokens)
        if limit < model_config.max_position_embeddings:
            logger.warning(
                "max_model_len capped at %d tokens by the KV cache size (model allows %d)",
                limit,
                model_config.max_position_embeddings,
            )
        return limit

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request; raises InvalidRequestError or QueueFullError. With
        params.n > 1 its samples are registered too (ids from sample_request_id): the prompt is
        computed once, then each sample reports under request_id with its index."""
        check_new_request(
            request_id,
            prompt_token_ids,
            params,
            priority,
            ids_in_use=self.requests,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            validate_params=validate_sampling_params,
        )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n is {params.n}, but this engine runs at most {self.config.max_num_seqs} "
                "sequences at once (max_num_seqs), and a request's samples run side by side"
            )
        request = Request(request_id, list(prompt_token_ids), params, priority=priority)
        if any(sample.request_id in self.requests for sample in request.samples):
            raise InvalidRequestError(
                f"request_id {request_id!r}: the ids of its samples ({request_id}#<index>) are "
                "already in use"
            )
        if params.structured_output is not None:
            self.structured.add(request)
        self.scheduler.add_request(request)
        # Its (and its samples') sampling rows are built now, not at every step it samples.
        self.sampler.join(request)
        self.requests[request_id] = request
        for sample in request.samples:
            self.requests[sample.request_id] = sample
        return request

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request and free its KV blocks. Returns its last outputs (finish reason
        ABORT): one, or one per live sample of an n > 1 request; a sample's own id
        (sample_request_id) stops that sample alone. Empty if unknown or already done."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        ended = list(request.samples) or [request]
        for r in ended:
            self._retire(r)
        return [aborted_output(r) for r in ended]

    def _retire(self, request: Request) -> None:
        """Drop a finished or aborted request from the engine and free its KV blocks; the
        last live sample of an n > 1 request takes that request with it."""
        self.scheduler.finish(request)
        self.structured.release(request)
        self.sampler.leave(request)
        del self.requests[request.request_id]
        parent = request.parent
        if parent is not None:
            parent.samples.remove(request)
            if not parent.samples:
                self._retire(parent)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent); the engine is unusable after."""
        if self.group is not None:
            self.group.close()

    def add_failure_listener(self, listener) -> None:
        """`listener(EngineGroupError)` runs (in another thread) if a tensor-parallel rank dies
        or hangs; single-process engines never call it."""
        if self.group is not None:
            self.group.add_failure_listener(listener)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def dtype_name(self) -> str:
        """The weights' and activations' dtype, e.g. "float32"."""
        return str(self.runner.dtype).removeprefix("torch.")

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        self.kv_events.publish(self.kv_cache.take_kv_events())
        return outputs

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.is_empty:
            return []
        model_input = self._on_ranks(self.runner.prepare, sched.plan)
        # Structured output: the grammars' masks are computed while the forward runs.
        masks = self.structured.start_masks(sched.sampling_requests)
        t2 = time.perf_counter()
        logits = self._on_ranks(self.runner.forward, model_input)
        t3 = time.perf_counter()
        # Rows past the sampled ones are prompt positions whose logprobs were asked.
        num_sampled = model_input.num_sampled
        sampled = self.sampler.sample(
            logits[:num_sampled],
            sched.sampling_requests,
            masks.result() if masks is not None else None,
        )
        if sched.plan.prompt_logprob_spans:
            record_prompt_logprobs(
                logits[num_sampled:, : self.vocab_size],
                sched.plan.prompt_logprob_spans,
                sched.requests,
            )
        t4 = time.perf_counter()
        outputs = self._update(
            sched.requests, sched.num_new_tokens, sched.sampling_requests, sampled
        )
        t5 = time.perf_counter()
        self.timings.add(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
        return outputs

    def _on_ranks(self, run, arg):
        """run(arg): a runner phase. With several ranks (the plan's broadcast, the forward's
        collectives) any failure leaves them out of step: the group is done."""
        if self.group is None:
            return run(arg)
        self.group.raise_if_failed()
        try:
            return run(arg)
        except Exception as exc:
            raise self.group.step_failed(exc) from exc

    def _update(
        self,
        scheduled: list[Request],
        num_new_tokens: list[int],
        sampling_requests: list[Request],
        sampled: SamplerOutput,
    ) -> list[RequestOutput]:
        for request, num_new in zip(scheduled, num_new_tokens, strict=False):
            request.num_computed_tokens += num_new
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
                new_token_ids, logprobs, reason = [], None, FinishReason.LENGTH
            else:
                token_id = sampled.token_ids[row]
                new_token_ids = [token_id]
                request.append_output(token_id)
                logprobs = sampled.logprobs[row]
                if logprobs is not None:
                    request.output_logprobs.append(logprobs)
                reason = check_stop(request, self.eos_token_ids, self.max_model_len)
                if (
                    request.sampling_params.structured_output is not None
                    and self.structured.advance(request)
                    and reason is None
                ):
                    reason = FinishReason.STOP  # the grammar is complete
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
                    new_logprobs=[logprobs] if logprobs is not None else [],
                    prompt_logprobs=self._first_output_prompt_logprobs(request),
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=request.num_output_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_seconds=_queue_seconds(request) if reason is not None else 0.0,
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
