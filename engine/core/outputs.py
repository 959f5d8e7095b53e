"""What the engine hands back after each step: per request, the tokens it gained.

Plain data; the offline API turns it into text and the engine service into protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.finish_reason import FinishReason


@dataclass
class RequestOutput:
    """One request's progress in one step (or its end)."""

    request_id: str
    new_token_ids: list[int]
    # Which sample of an n > 1 request (0 otherwise): each sample ends with its own output.
    index: int = 0
    # Per new token: (chosen token logprob, top alternatives) when logprobs were asked.
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
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


@dataclass
class StepTimings:
    """Seconds spent in each phase of the engine step, accumulated over steps."""

    schedule: float = 0.0
    prepare_inputs: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    steps: int = 0

    PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update")

    def reset(self) -> None:
        for name in self.PHASES:
            setattr(self, name, 0.0)
        self.steps = 0

    def add(self, *durations: float) -> None:
        for name, seconds in zip(self.PHASES, durations, strict=False):
            setattr(self, name, getattr(self, name) + seconds)
        self.steps += 1

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in self.PHASES)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.PHASES}


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
