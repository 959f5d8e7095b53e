"""Per-request sampling parameters and their validation.

Holds data only: the sampler reads it, the scheduler never does (except `priority`, which
lives on the request). Validation names the offending parameter in its message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 (or below 1e-5) is greedy (exact argmax). top_k <= 0 disables top-k. max_tokens None means
    "until the context is full". logprobs None returns none; k >= 0 returns the chosen token's
    logprob and the top k alternatives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    MAX_LOGPROBS = 20
    # Below this a temperature only overflows the division; such rows are greedy.
    MIN_TEMPERATURE = 1e-5

    @property
    def greedy(self) -> bool:
        return self.temperature < self.MIN_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter."""

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        def integer(name: str, value: object) -> None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        integer("top_k", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens)
            if self.max_tokens <= 0:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None:
            integer("seed", self.seed)
        if self.logprobs is not None:
            integer("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= self.MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}"
                )
        token_lists = [("stop_token_ids", list(self.stop_token_ids))]
        if self.logit_bias:
            token_lists.append(("logit_bias", list(self.logit_bias)))
            for token_id, bias in self.logit_bias.items():
                finite(f"logit_bias[{token_id}]", bias)
        for name, ids in token_lists:
            for token_id in ids:
                integer(name, token_id)
                if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                    raise ValueError(
                        f"{name} contains token id {token_id}, outside the vocabulary "
                        f"[0, {vocab_size})"
                    )
