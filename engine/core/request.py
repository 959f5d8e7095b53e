"""The state of one request inside the engine.

A request advances `num_computed_tokens` towards `num_tokens` (prompt plus output so far);
prefill, chunked prefill, decode and recompute after preemption are all that one motion.
A request with n > 1 (a parent) computes its prompt once, then forks into n samples: requests
of their own (ids from sample_request_id) that start with the parent's computed prompt and
report under the parent's id with their index. A request may come with a service level: its
tenant and that tenant's weight (the fair policy's shares), and deadlines for its first token and
its end. This module holds state (and the shape checks of a prompt, the last output of a request
ended early) only: scheduling, KV allocation and sampling (a seeded request's generator included)
live elsewhere.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from common.block_hash import ROOT_HASH
from common.errors import InvalidRequestError
from common.finish_reason import FinishReason
from common.pooling_params import PoolingParams
from common.sampling_params import BATCH_PRIORITY, SamplingParams, sample_request_id
from common.service_level import NO_SERVICE_LEVEL, ServiceLevel
from engine.core.outputs import RequestOutput


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


# Numbers requests (samples included) for the step plan: unique within the process, never reused.
_SEQ_IDS = itertools.count()


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.monotonic) for metrics."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    times: RequestTimes = field(default_factory=lambda: RequestTimes(arrival=time.monotonic()))
    service: ServiceLevel = NO_SERVICE_LEVEL

    output_token_ids: list[int] = field(default_factory=list)
    # Logprob records for output tokens, when sampling_params.logprobs is set:
    # (chosen token logprob, [(token id, logprob) of the top alternatives]).
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # The same records for prompt tokens 1, 2, ... as far as computed, when
    # sampling_params.prompt_logprobs is set (token 0 has none: nothing precedes it).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # prompt + output, kept as one list so the hot path never concatenates.
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens whose KV came from the prefix cache when the request was last admitted.
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # KV cache: physical block ids in logical order, and the chained hashes of its full blocks.
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    # n > 1: the samples it forks into once its prompt is computed, then those still live.
    samples: list[Request] = field(default_factory=list, repr=False)
    # On a sample: the request it was forked from, and its index among that request's n.
    parent: Request | None = field(default=None, repr=False)
    sample_index: int = 0
    # Set: an embedding request. It computes its prompt once and is pooled into one vector (by
    # the executor), generating nothing; its sampling_params are the defaults, never used.
    pooling: PoolingParams | None = None
    # LoRA (engine.lora.registry): the adapter it runs with (None: the base model), the model's
    # slot holding that adapter while it runs (-1: none), and the root of its block hash chain.
    lora_name: str | None = None
    lora_slot: int = -1
    hash_root: bytes = ROOT_HASH
    # Pinning (engine.kv_tiers.pins): keep the prompt's full blocks for this many seconds from
    # when they are cached (0: no pin), and how many of them are pinned so far; whose pin it is
    # (the gateway's name for an API key; "": the one owner of requests naming none) and how
    # many blocks that owner may pin (None: no bound but the engine's).
    pin_ttl_seconds: float = 0.0
    num_pinned_blocks: int = 0
    pin_owner: str = ""
    pin_owner_max_blocks: int | None = None
    # The request's name in step plans (engine.core.step_plan): an int, so plans stay numeric.
    seq_id: int = field(init=False)
    # Speculative decoding (engine.spec_decode): the tokens drafted for the next step to verify
    # after its last token (never part of token_ids), and how many were drafted and accepted.
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.seq_id = next(_SEQ_IDS)
        params = self.sampling_params
        if params.n > 1 and self.parent is None:
            self.samples = [
                Request(
                    sample_request_id(self.request_id, i),
                    self.prompt_token_ids,
                    dataclasses.replace(params, n=1, seed=params.sample_seed(i)),
                    priority=self.priority,
                    service=self.service,
                    parent=self,
                    sample_index=i,
                )
                for i in range(params.n)
            ]

    @property
    def caller_id(self) -> str:
        """The id its outputs carry: the one the caller gave (a sample's is its parent's)."""
        return self.parent.request_id if self.parent is not None else self.request_id

    @property
    def is_batch(self) -> bool:
        """In the batch lane: runs on capacity interactive requests leave, preempted first."""
        return self.priority >= BATCH_PRIORITY

    @property
    def tenant(self) -> str:
        return self.service.tenant

    @property
    def ttft_deadline(self) -> float:
        """When its first token is due (time.monotonic seconds; inf: never)."""
        ttft_ms = self.service.ttft_ms
        return math.inf if ttft_ms is None else self.times.arrival + ttft_ms / 1000

    @property
    def total_deadline(self) -> float:
        """When it must have ended (time.monotonic seconds; inf: never)."""
        total_ms = self.service.total_ms
        return math.inf if total_ms is None else self.times.arrival + total_ms / 1000

    @property
    def deadline(self) -> float:
        """The deadline that orders it among waiting requests (earliest first): its first
        token's until it has one, then its end's."""
        if self.times.first_token is None:
            return min(self.ttft_deadline, self.total_deadline)
        return self.total_deadline

    @property
    def num_seqs(self) -> int:
        """How many sequences it runs as: its live samples until it forks, else 1."""
        return len(self.samples) or 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked and some are still to compute (a sample's are its
        parent's: the parent computed the prompt)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len((self.parent or self).prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


def check_new_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    priority: int,
    *,
    ids_in_use: Container[str],
    max_model_len: int,
    vocab_size: int,
    validate_params: Callable[[SamplingParams, int], None],
    pooling: PoolingParams | None = None,
    service: ServiceLevel = NO_SERVICE_LEVEL,
) -> None:
    """The checks every engine (real or simulated) makes of a new request, in this order: its
    id is free, its prompt valid, `validate_params(params, vocab_size)` passes (its ValueError
    becomes an InvalidRequestError naming the parameter), its priority is an integer, its
    service level in range."""
    if request_id in ids_in_use:
        raise InvalidRequestError(f"request_id {request_id!r} is already in use")
    validate_prompt(prompt_token_ids, max_model_len, vocab_size, room_for_output=pooling is None)
    if pooling is not None:
        pooling.validate()
    try:
        validate_params(params, vocab_size)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), getattr(exc, "param", None)) from None
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
    service.check()


def validate_prompt(
    prompt_token_ids: list[int], max_model_len: int, vocab_size: int, room_for_output: bool = True
) -> None:
    """InvalidRequestError unless the prompt is non-empty, fits the context (leaving room for
    one generated token, with `room_for_output`; an embedding request generates none) and holds
    only ids inside the vocabulary."""
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("prompt_token_ids must not be empty")
    if not room_for_output and len(prompt_token_ids) > max_model_len:
        raise InvalidRequestError(
            f"prompt_token_ids has {len(prompt_token_ids)} tokens, over the model's context "
            f"(max_model_len) of {max_model_len} tokens"
        )
    if room_for_output and len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt_token_ids has {len(prompt_token_ids)} tokens, but the model's context "
            f"(max_model_len) is {max_model_len} tokens, which must include at least "
            "one generated token"
        )
    for token_id in prompt_token_ids:
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"prompt_token_ids contains {token_id!r}, outside the vocabulary [0, {vocab_size})"
            )


def ended_output(request: Request, reason: FinishReason) -> RequestOutput:
    """The last output of a request (or sample) ended outside a step: aborted, or past its
    deadline."""
    return RequestOutput(
        request_id=request.caller_id,
        index=request.sample_index,
        new_token_ids=[],
        finished=True,
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        queue_seconds=(request.times.first_scheduled or time.monotonic()) - request.times.arrival,
        # Aborted at a stop string the gateway matched: its usage still counts its drafts.
        num_draft_tokens=request.num_drafted_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
    )
