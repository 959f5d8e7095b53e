"""The plain data of the gateway's text path: what a front end asks for (TextRequest) and what
comes back (TextDelta, with TokenLogprob and Usage).

Data only: nothing here talks to a service, validates, or knows a wire format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams


@dataclass
class TextRequest:
    """One prompt to generate from, validated and fitted to the context: `params.n` choices,
    which run as one engine request (the prompt computed once). With `pooling`, an embedding
    request: one choice, its only delta carries the vector, `params` only count (max_tokens 0)."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    pooling: PoolingParams | None = None

    @property
    def max_tokens(self) -> int:
        """params.max_tokens, which fitting to the context always sets."""
        if self.params.max_tokens is None:
            raise ValueError("a TextRequest's max_tokens is set when it is fitted to the context")
        return self.params.max_tokens


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # the token decoded on its own
    logprob: float | None  # None for a prompt's first token: nothing precedes it
    top: list[tuple[int, str, float]]  # (token id, text, logprob), most likely first


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Speculative decoding: drafted tokens, and how many were accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class TextDelta:
    """Text that became certain; the last delta of a sequence has finish_reason and usage."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    # On a sequence's first delta, when prompt logprobs were asked: one per prompt token.
    prompt_logprobs: list[TokenLogprob] | None = None
    # On the last delta when a stop string ended the sequence: that string.
    stop_matched: str | None = None
    # An embedding request's only delta: its vector.
    embedding: list[float] | None = None
    # The sequence's tokens so far, this delta's included.
    completion_tokens: int = 0
