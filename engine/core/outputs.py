"""What a step yields: the tokens an executor sampled, and what the engine hands back per
request (the tokens it gained), with the engine's timings and load.

Plain data; the offline API turns it into text and the engine service into protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.finish_reason import FinishReason

# One token's logprob record: (logprob of the token, [(token id, logprob)] of the top
# alternatives, most likely first).
Logprobs = tuple[float, list[tuple[int, float]]]


# What a row samples when its constraints leave it no token (never a token id): the request
# ends before it.
NO_TOKEN = -1


@dataclass
class SamplerOutput:
    """One token per sampled row of a step."""

    token_ids: list[int]
    # Per row: None unless the request asked for logprobs.
    logprobs: list[Logprobs | None]
    # Speculative decoding: per row, the drafted tokens verification accepted, which come
    # before token_ids[row] (and their logprob records, when asked); None when no row drafted.
    accepted: list[list[int]] | None = None
    accepted_logprobs: list[list[Logprobs]] | None = None


@dataclass
class RequestOutput:
    """One request's progress in one step (or its end)."""

    request_id: str
    new_token_ids: list[int]
    # Which sample of an n > 1 request (0 otherwise): each sample ends with its own output.
    index: int = 0
    # Per new token, when logprobs were asked.
    new_logprobs: list[Logprobs] = field(default_factory=list)
    # On the request's first output, when prompt logprobs were asked: per prompt token after
    # the first, (token id, its logprob, top alternatives).
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # On the last output: seconds from arrival to first scheduling (to the end if never run).
    queue_seconds: float = 0.0
    # An embedding request's one output: its pooled vector, L2-normalised.
    embedding: list[float] | None = None
    # Speculative decoding: tokens drafted for the request so far, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class StepTimings:
    """Seconds spent in each phase of the engine step, accumulated over steps."""

    schedule: float = 0.0
    prepare_inputs: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    steps: int = 0
    # How far steps ran past the time their executor modelled for them (the simulated one's
    # cost model: its "forward"), so a benchmark can tell whether the modelled times held; None
    # while no step was modelled.
    overrun: float | None = None

    PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update")

    def reset(self) -> None:
        for name in self.PHASES:
            setattr(self, name, 0.0)
        self.steps = 0
        if self.overrun is not None:
            self.overrun = 0.0

    def add_overrun(self, seconds: float) -> None:
        self.overrun = (self.overrun or 0.0) + max(0.0, seconds)

    def add(self, *durations: float) -> None:
        for name, seconds in zip(self.PHASES, durations, strict=False):
            setattr(self, name, getattr(self, name) + seconds)
        self.steps += 1

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in self.PHASES)

    def as_dict(self) -> dict[str, float]:
        phases = {name: getattr(self, name) for name in self.PHASES}
        return phases if self.overrun is None else {**phases, "overrun": self.overrun}


@dataclass
class EngineStats:
    """Load and cumulative counters, read between steps."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # For routers: prompt tokens admitted and not computed yet; the live step cost model's
    # seconds per prefill token and one step's seconds beside the sequences decoding now.
    queued_prefill_tokens: int = 0
    prefill_token_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    # Speculative decoding (vLLM's counters): verification steps of a request with drafts,
    # drafted tokens, accepted tokens.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # KV cache tiers (engine.kv_tiers), per tier in use: prompt tokens served from it since the
    # start (counted in prefix_cache_hits too), and the share of its capacity in use.
    kv_tier_hits: dict[str, int] = field(default_factory=dict)
    kv_tier_usage: dict[str, float] = field(default_factory=dict)
    # Prompt blocks pinned now (engine.kv_tiers.pins: each hash once, in any tier).
    kv_pinned_blocks: int = 0
    # LoRA adapters (engine.lora.registry; empty without them): those of the running and of the
    # waiting requests, those in the model's slots, the slots, requests per adapter since start.
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    resident_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
    lora_requests: dict[str, int] = field(default_factory=dict)
