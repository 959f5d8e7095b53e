"""The Executor protocol: what the engine loop (engine.engine.LLMEngine) asks of whatever runs
its steps.

The loop is the same for every executor: it validates and admits requests, schedules each step
(engine.core.scheduler) and updates the requests with the tokens the step sampled (computed
tokens, prefix-cache blocks, stop conditions, outputs). An executor runs a scheduled step and
returns one token per sampled row, and one vector per embedding request the step completes. Two
implement it: the model executor (engine.model_executor: the model runner, the sampler, structured
output, tensor-parallel ranks) and the simulated one (engine.simulated: step times from a cost
model, placeholder tokens).

This module holds the protocol and the plain data an executor returns, nothing else; it never
imports torch, so the loop and the simulated executor stay torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import KVGroups
from engine.core.outputs import SamplerOutput
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.errors import EngineGroupError
from engine.kv_tiers.book import TierBook
from engine.lora.registry import LoraBackend
from engine.spec_decode.drafter import DraftProposer


@dataclass
class ExecutorOutput:
    """One executed step: its sampled tokens, and how long the executor's phases took."""

    # Row i belongs to the step's sampling_requests[i].
    sampled: SamplerOutput
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    # The time the whole step was meant to take, for an executor that models it (the simulated
    # one), so the loop can count how far steps overran it; None for one that really runs.
    modelled_seconds: float | None = None
    # Row i belongs to the step's pooling_requests[i]: its embedding, as the caller gets it.
    embeddings: list[list[float]] = field(default_factory=list)


class Executor(Protocol):
    # The model directory (its tokenizer is the engine's), the model's vocabulary and EOS ids.
    model_path: Path
    vocab_size: int
    eos_token_ids: frozenset[int]
    # The KV pool the scheduler hands out, in blocks of config.block_size, and the longest
    # sequence (prompt + output) a request may reach.
    num_blocks: int
    max_model_len: int
    # How the model's layers share the KV pool: sliding-window layers apart (their blocks freed
    # out of the window), all layers one group otherwise.
    kv_groups: KVGroups
    # The bytes of KV one logical block of a sequence takes (every layer and KV group, on every
    # rank): what pinning one prompt block keeps.
    kv_block_bytes: int
    # The books of the KV tiers below the pool (engine.kv_tiers), None without tiers.
    kv_tier_book: TierBook | None
    # What holds LoRA adapters' weights (engine.lora.registry); None: it serves none.
    lora_backend: LoraBackend | None
    # The draft model of --speculative-config's draft_model method; None without one.
    draft_proposer: DraftProposer | None
    # The most rows a step may have for each to be computed as it would be in any other step
    # (quantized weights take their kernels up to it: engine.decode_programs.kernel_rows); None:
    # no bound. Speculative decoding keeps its verification steps within it.
    max_invariant_rows: int | None

    @property
    def dtype_name(self) -> str:
        """The weights' and activations' dtype as the engine reports it, e.g. "float32"."""
        ...

    @property
    def kv_cache_dtype_name(self) -> str:
        """The KV pool's dtype, e.g. "bfloat16" (--kv-cache-dtype)."""
        ...

    def validate_params(self, params: SamplingParams, vocab_size: int) -> None:
        """ValueError naming the first parameter this executor cannot serve."""
        ...

    def join(self, request: Request) -> None:
        """A validated request (with its samples, n > 1) about to be queued: build what running
        it needs, once; InvalidRequestError if it cannot run here. Whatever is kept is keyed
        weakly, so a request the queue then refuses leaves nothing behind. An embedding request
        (request.pooling) it cannot pool, or a generation request it serves no text for, is an
        InvalidRequestError too."""
        ...

    def leave(self, request: Request) -> None:
        """A finished or aborted request (or one sample): drop what join built for it."""
        ...

    def execute(self, step: SchedulerOutput, started: float) -> ExecutorOutput:
        """Run the step (step.plan; step.requests and step.sampling_requests are rank 0's live
        view of it) and sample one token per sampling request. `started` is
        time.perf_counter() when the step began, scheduling included."""
        ...

    def constraint_ended(self, request: Request) -> bool:
        """After the request's newest output token: True when its constraint (a structured
        output grammar) is complete or broken, so the request must end."""
        ...

    def grammar_allows(self, request: Request, tokens: list[int]) -> int:
        """How many leading `tokens` the request's constraint accepts after its output so far
        (all of them for an unconstrained request): speculative drafts are cut there."""
        ...

    def close(self) -> None:
        """Release what the executor runs on (idempotent); it is unusable after."""
        ...

    def add_failure_listener(self, listener: Callable[[EngineGroupError], None]) -> None:
        """`listener` runs (in another thread) if a rank the executor spans dies or hangs."""
        ...
