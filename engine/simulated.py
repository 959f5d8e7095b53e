"""A simulated engine: the real scheduler and KV cache manager (prefix cache and KV events
included), no model. Each step takes the time a cost model gives for its work (a fixed cost,
a cost per prefill token, a cost per decoding sequence), fitted from a profile of the real
engine (`folio bench profile`), and every sampled token is one placeholder token. Dozens of them
fit in one process, so routing across many replicas can be studied on one machine.

A step that overruns its modelled time (the machine's CPU was the limit, not the model) is
counted: `timings` reports the overrun as its own phase, so a benchmark can tell whether the
modelled times held. It serves the same contract as engine.engine.LLMEngine for the loop
(engine.async_engine) and the engine service, except what needs a model: n > 1, logprobs,
prompt logprobs and structured output are refused. This module never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from common.config import EngineConfig
from common.default_model import resolve_model_path
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_events import KVEventPublisher
from engine.core.outputs import EngineStats, RequestOutput, StepTimings
from engine.core.request import Request, aborted_output, check_new_request
from engine.core.scheduler import Scheduler
from engine.core.stopping import check_stop
from engine.errors import EngineGroupError, InvalidRequestError
from engine.models.config import ModelConfig

# The pool of a simulated engine when neither num_kv_blocks nor a memory budget is meant (it
# has no tensors, so the memory budget means nothing).
DEFAULT_NUM_BLOCKS = 1024
# The placeholder token: a word that tokenizes back to itself when its text is sent again (a
# later turn of a chat quotes the answer), so prefix caching sees what it would see for real.
PLACEHOLDER_TEXT = " the"


@dataclass(frozen=True)
class StepCostModel:
    """Seconds one engine step takes: fixed + per prefill token + per decoding sequence."""

    fixed_seconds: float
    prefill_token_seconds: float
    decode_sequence_seconds: float

    def step_seconds(self, num_prefill_tokens: int, num_decodes: int) -> float:
        return (
            self.fixed_seconds
            + self.prefill_token_seconds * num_prefill_tokens
            + self.decode_sequence_seconds * num_decodes
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> StepCostModel:
        fields = json.loads(path.read_text())
        return cls(
            float(fields["fixed_seconds"]),
            float(fields["prefill_token_seconds"]),
            float(fields["decode_sequence_seconds"]),
        )


@dataclass
class SimulatedTimings(StepTimings):
    """The real engine's phases (all the modelled time counts as "forward"), and how far steps
    overran their modelled time in all."""

    overrun: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {**super().as_dict(), "overrun": self.overrun}


class SimulatedEngine:
    def __init__(
        self,
        config: EngineConfig,
        cost: StepCostModel,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.cost = cost
        self._sleep = sleep
        self.model_path: Path = resolve_model_path(config.model)
        model_config = ModelConfig.from_dir(self.model_path)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        [self.placeholder_token_id] = Tokenizer.from_dir(self.model_path).encode(
            PLACEHOLDER_TEXT, add_special_tokens=False
        )
        num_blocks = config.num_kv_blocks or DEFAULT_NUM_BLOCKS
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache)
        self.kv_events = KVEventPublisher(config.kv_events_replay_batches)
        self.requests: dict[str, Request] = {}
        self.timings = SimulatedTimings()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def dtype_name(self) -> str:
        return "simulated"

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> Request:
        check_new_request(
            request_id,
            prompt_token_ids,
            params,
            priority,
            ids_in_use=self.requests,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            validate_params=SamplingParams.validate,
        )
        for name, value in (
            ("n", params.n > 1),
            ("logprobs", params.logprobs is not None),
            ("prompt_logprobs", params.prompt_logprobs is not None),
            ("structured_output", params.structured_output is not None),
        ):
            if value:
                raise InvalidRequestError(f"a simulated engine does not do {name}", name)
        # No sampling happens: a seed would only make the request build a torch generator.
        request = Request(
            request_id,
            list(prompt_token_ids),
            dataclasses.replace(params, seed=None),
            priority=priority,
        )
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request

    def abort(self, request_id: str) -> list[RequestOutput]:
        request = self.requests.get(request_id)
        if request is None:
            return []
        self._retire(request)
        return [aborted_output(request)]

    def _retire(self, request: Request) -> None:
        self.scheduler.finish(request)
        del self.requests[request.request_id]

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def close(self) -> None:
        pass

    def add_failure_listener(self, listener: Callable[[EngineGroupError], None]) -> None:
        pass  # one process, no ranks to lose

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if not sched.is_empty:
            num_decodes = sched.num_decodes
            modelled = self.cost.step_seconds(sched.total_tokens - num_decodes, num_decodes)
            scheduled = time.perf_counter()
            left = start + modelled - scheduled
            if left > 0:
                self._sleep(left)
            slept = time.perf_counter()
            outputs = self._update(sched.requests, sched.num_new_tokens, sched.sampling_requests)
            end = time.perf_counter()
            self.timings.add(scheduled - start, 0.0, slept - scheduled, 0.0, end - slept)
            self.timings.overrun += max(0.0, (end - start) - modelled)
        self.kv_events.publish(self.kv_cache.take_kv_events())
        return outputs

    def _update(
        self, scheduled: list[Request], num_new_tokens: list[int], sampling: list[Request]
    ) -> list[RequestOutput]:
        for request, num_new in zip(scheduled, num_new_tokens, strict=True):
            request.num_computed_tokens += num_new
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
        now = time.monotonic()
        outputs = []
        for request in sampling:
            request.append_output(self.placeholder_token_id)
            reason: FinishReason | None = check_stop(
                request, self.eos_token_ids, self.max_model_len
            )
            if request.times.first_token is None:
                request.times.first_token = now
            if reason is not None:
                request.finish_reason = reason
                request.times.finished = now
                self._retire(request)
            first_scheduled = request.times.first_scheduled or now
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[self.placeholder_token_id],
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=request.num_output_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_seconds=first_scheduled - request.times.arrival if reason else 0.0,
                )
            )
        return outputs
