"""`--speculative-config JSON`: which proposer drafts tokens for the engine to verify, with
vLLM's keys, parsed and checked once at start-up.

Keys: `method` ("ngram", "suffix", "draft_model"), and `num_speculative_tokens` (the most
tokens drafted per request and step, 1..MAX_SPECULATIVE_TOKENS); for ngram `prompt_lookup_min` /
`prompt_lookup_max` (the n-gram lengths matched); for suffix `suffix_decoding_max_tree_depth`
(the longest suffix matched) and `suffix_decoding_max_cached_requests` (how many recent outputs
it searches too); for draft_model `model` (the draft model's directory or GGUF file, required)
and `quantization` (its linears' weight-only quantization, as --quantization). An unknown key
or method, or a value out of range, is a ValueError naming the key. Plain data: this module
only checks that the draft model's path exists; it never reads or loads a model (the model
executor does, and refuses a draft whose vocabulary is not the target's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
# The keys that are strings; every other key but `method` is an integer.
_STRING_KEYS = ("model", "quantization")
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(ValueError):
    """A bad --speculative-config, naming its key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"speculative_config: {key}: {message}")
        self.key = key


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 64
    model: str | None = None
    quantization: str | None = None

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError("(json)", f"not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise SpeculativeConfigError("(json)", "must be a JSON object")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise SpeculativeConfigError(
                    key, f"unknown key (known: {', '.join(sorted(known))})"
                )
        if "method" not in values:
            raise SpeculativeConfigError("method", f"required, one of {SPECULATIVE_METHODS}")
        method = values["method"]
        if method not in SPECULATIVE_METHODS:
            raise SpeculativeConfigError(
                "method", f"unknown method {method!r}, expected one of {SPECULATIVE_METHODS}"
            )
        for key, value in values.items():
            if key in _STRING_KEYS:
                if not isinstance(value, str):
                    raise SpeculativeConfigError(key, f"must be a string, got {value!r}")
            elif key != "method" and (not isinstance(value, int) or isinstance(value, bool)):
                raise SpeculativeConfigError(key, f"must be an integer, got {value!r}")
        config = cls(**values)
        config._check()
        return config

    def _check(self) -> None:
        def at_least(key: str, low: int, high: int | None = None) -> None:
            value = getattr(self, key)
            if value < low or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise SpeculativeConfigError(key, f"must be {bound}, got {value}")

        at_least("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        at_least("prompt_lookup_min", 1)
        at_least("prompt_lookup_max", self.prompt_lookup_min)
        at_least("suffix_decoding_max_tree_depth", 2)
        at_least("suffix_decoding_max_cached_requests", 0)
        self._check_draft_model()

    def _check_draft_model(self) -> None:
        if self.method != "draft_model":
            for key in _STRING_KEYS:
                if getattr(self, key) is not None:
                    raise SpeculativeConfigError(key, "only for method draft_model")
            return
        if self.model is None:
            raise SpeculativeConfigError(
                "model", "required for method draft_model: the draft model's directory"
            )
        path = Path(self.model)
        if not (path / "config.json").is_file() and not (path.suffix == ".gguf" and path.is_file()):
            raise SpeculativeConfigError(
                "model",
                f"no model at {self.model!r} (a directory with config.json, or a .gguf file)",
            )
        # Imported here: common.config imports this module.
        from common.config import QUANTIZATIONS

        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise SpeculativeConfigError(
                "quantization",
                f"unknown quantization {self.quantization!r}, expected one of {QUANTIZATIONS}",
            )
