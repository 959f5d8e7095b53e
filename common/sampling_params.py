"""Per-request sampling parameters and their validation: plain data, part of the contract
every service shares.

Holds data only: the engine's sampler reads it, its scheduler never does (except `priority`,
which lives on the request). Validation names the offending parameter in its message and checks
shapes and ranges only: whether a structured-output grammar compiles is the engine's to say
(engine/grammar.py), so this module must never import torch, llguidance or the engine. It also
names the samples of an n > 1 request (their seeds and ids).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import ClassVar

from common.errors import InvalidRequestError

# The batch lane: a request whose priority is at least this (an int32, as the wire carries it)
# runs only on capacity no interactive request wants, and is preempted first. Batch jobs send
# exactly this; larger values order batch requests among themselves under the priority policy.
BATCH_PRIORITY = 1 << 30


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text (vLLM's `structured_outputs`), exactly one of:
    json, a JSON schema (JSON text; a dict is serialized); regex, which the whole output
    matches; choice, strings the output is exactly one of; grammar, in Lark or llama.cpp's GBNF;
    json_object, any JSON object. Frozen and hashable: it keys the engine's compiled grammars.
    `source` labels where it came from, as the client named it (e.g. "response_format"): error
    messages about it start with that label. It is not part of the constraint (left out of eq
    and hash, so equal constraints from different fields share one compiled grammar).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    source: str | None = field(default=None, compare=False)

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")
    DESCRIPTIONS: ClassVar[dict[str, str]] = {
        "json": "JSON schema",
        "regex": "regular expression",
        "choice": "choice list",
        "grammar": "grammar",
        "json_object": "JSON object",
    }

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The one kind set (validate() first)."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def label(self) -> str:
        """What error messages about this constraint start with: its source, if labelled."""
        return self.source or "structured_output"

    def validate(self) -> None:
        """Raise InvalidRequestError (a ValueError), its message starting with the constraint's
        label and its param the source, unless exactly one kind is set, with a value of the
        right type. Whether its grammar compiles is engine.grammar.check_grammar's to say."""
        name = self.label
        kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError(
                f"{name} must set exactly one of json, regex, choice, grammar or "
                f"json_object, got {' and '.join(kinds) or 'none'}",
                self.source,
            )
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "choice":
            if not value or not all(isinstance(c, str) for c in value):
                raise InvalidRequestError(
                    f"{name}.choice must be a non-empty list of strings", self.source
                )
        elif not isinstance(value, bool if kind == "json_object" else str):
            raise InvalidRequestError(
                f"{name}.{kind} must be a {'boolean' if kind == 'json_object' else 'string'}",
                self.source,
            )


SEED_MASK = (1 << 63) - 1  # seeds travel as int64


def sample_request_id(request_id: str, index: int) -> str:
    """The id of sample `index` of an n > 1 request, which addresses that sample alone (to
    abort it); its outputs still carry the request's own id, and the index."""
    return f"{request_id}#{index}"


def parent_request_id(request_id: str) -> str | None:
    """The request that a sample id (from sample_request_id) belongs to; None for other ids."""
    parent, sep, index = request_id.rpartition("#")
    return parent if sep and index.isdigit() else None


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 (or below 1e-5) is greedy (exact argmax). top_k <= 0 disables top-k.
    max_tokens None means "until the context is full". logprobs None returns none; k >= 0
    returns the chosen token's logprob and the top k alternatives. structured_output limits
    every token to what its grammar allows, EOS only where the grammar is complete; the request
    ends when the grammar can go no further. allowed_token_ids (None: all) limits every token to
    those ids. bad_words_token_ids bans token sequences from the output: a sequence's last token
    wherever the output ends with the rest of it (a one-token sequence everywhere).
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
    # Independent samples of the prompt: it is computed once, then the samples share its KV
    # blocks copy-on-write; sample i draws from seed + i (see sample_seed).
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    MAX_LOGPROBS = 20
    MAX_N = 64
    # Each bad word is checked against the output at every step of the request.
    MAX_BAD_WORDS = 512
    # OpenAI's documented range (-100 bans a token, 100 all but forces it); a bias past
    # float32's range made the row's probabilities NaN and sampled arbitrary tokens.
    MAX_LOGIT_BIAS = 100.0
    # Below this a penalty's division overflows float32 and the row's probabilities turn NaN.
    MIN_REPETITION_PENALTY = 1e-5
    # Below this a temperature only overflows the division; such rows are greedy.
    MIN_TEMPERATURE = 1e-5

    @property
    def greedy(self) -> bool:
        return self.temperature < self.MIN_TEMPERATURE

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` of n: seed + index, wrapped to the int64 range seeds
        travel in, so seeded samples differ from each other and each one is reproducible."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index) & SEED_MASK

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
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        def integer(name: str, value: object) -> None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        integer("top_k", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty < self.MIN_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be >= {self.MIN_REPETITION_PENALTY:g}, "
                f"got {self.repetition_penalty}"
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens)
            if self.max_tokens == 0 and self.prompt_logprobs is None:
                raise ValueError("max_tokens must be >= 1 (0 only with prompt_logprobs), got 0")
            if self.max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None:
            integer("seed", self.seed)
        integer("n", self.n)
        if not 1 <= self.n <= self.MAX_N:
            raise ValueError(f"n must be in [1, {self.MAX_N}], got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                integer(name, value)
                if not 0 <= value <= self.MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {self.MAX_LOGPROBS}], got {value}")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError(
                    f"structured_output must be a StructuredOutput, got {self.structured_output!r}"
                )
            self.structured_output.validate()
        token_lists = [("stop_token_ids", list(self.stop_token_ids))]
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            token_lists.append(("allowed_token_ids", list(self.allowed_token_ids)))
        if len(self.bad_words_token_ids) > self.MAX_BAD_WORDS:
            raise ValueError(
                f"bad_words_token_ids holds {len(self.bad_words_token_ids)} sequences, over the "
                f"limit of {self.MAX_BAD_WORDS}"
            )
        for i, word in enumerate(self.bad_words_token_ids):
            if not isinstance(word, (list, tuple)) or not word:
                raise ValueError(f"bad_words_token_ids[{i}] must be a non-empty list of token ids")
            token_lists.append((f"bad_words_token_ids[{i}]", list(word)))
        if self.logit_bias:
            token_lists.append(("logit_bias", list(self.logit_bias)))
            for token_id, bias in self.logit_bias.items():
                finite(f"logit_bias[{token_id}]", bias)
                if abs(bias) > self.MAX_LOGIT_BIAS:
                    limit = self.MAX_LOGIT_BIAS
                    raise ValueError(
                        f"logit_bias[{token_id}] must be in [{-limit:g}, {limit:g}], got {bias}"
                    )
        for name, ids in token_lists:
            for token_id in ids:
                integer(name, token_id)
                if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                    raise ValueError(
                        f"{name} contains token id {token_id}, outside the vocabulary "
                        f"[0, {vocab_size})"
                    )
