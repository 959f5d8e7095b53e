"""The sampling defaults a model recommends (its generation_config.json), as vLLM's
--generation-config reads them: what an OpenAI-style request leaves unset is sampled with these
instead of the API's own defaults, and `max_new_tokens` caps every request's max_tokens.

Plain data and one small file read: no tokenizer, no engine. It never decides anything a
request sets itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# --generation-config's values besides a directory: the model's own file, or none at all
# (Folio's defaults; vLLM names that setting "vllm", which means the same here).
MODEL_SETTING = "auto"
NO_DEFAULTS_SETTINGS = ("folio", "vllm")
FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults a model's file gives, None where it gives none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens: a cap on every request

    def given(self) -> dict[str, Any]:
        """The defaults that are set, by name (the log line, GetInfo's message)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}


# The generation_config.json key of each SamplingDefaults field.
FILE_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}
INTEGER_FIELDS = ("top_k", "max_tokens")


def check_setting(setting: str) -> None:
    """ValueError naming --generation-config unless it is auto, folio (or vllm), or a
    directory that holds a generation_config.json."""
    if setting == MODEL_SETTING or setting in NO_DEFAULTS_SETTINGS:
        return
    if not (Path(setting).expanduser() / FILE_NAME).is_file():
        raise ValueError(
            f"generation_config must be auto, folio (or vllm) or a directory holding "
            f"{FILE_NAME}; {setting!r} is none of these"
        )


def parse_override(text: str | None) -> dict[str, Any]:
    """--override-generation-config's JSON object, by generation_config.json key; ValueError
    naming the flag and the key for anything else."""
    if text is None:
        return {}
    try:
        override = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"override_generation_config is not JSON: {exc}") from None
    if not isinstance(override, dict):
        raise ValueError("override_generation_config must be a JSON object")
    for key, value in override.items():
        if key not in FILE_KEYS.values():
            known = ", ".join(FILE_KEYS.values())
            raise ValueError(f"override_generation_config: unknown key {key!r} (known: {known})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"override_generation_config: {key} must be a number, got {value!r}")
    return override


def read_sampling_defaults(
    model_path: Path, setting: str, override: str | None = None
) -> SamplingDefaults:
    """The defaults --generation-config `setting` gives for the model at `model_path` (a
    directory, or a GGUF file, which carries none), with --override-generation-config's on
    top; ValueError where the result is no valid sampling (naming the field)."""
    check_setting(setting)
    config: dict[str, Any] = {}
    directory = model_path if setting == MODEL_SETTING else Path(setting).expanduser()
    if setting not in NO_DEFAULTS_SETTINGS and (directory / FILE_NAME).is_file():
        config = json.loads((directory / FILE_NAME).read_text())
    config.update(parse_override(override))
    values: dict[str, Any] = {}
    for name, key in FILE_KEYS.items():
        value = config.get(key)
        # bool is an int to Python; a file's true is no temperature.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = int(value) if name in INTEGER_FIELDS else float(value)
    defaults = SamplingDefaults(**values)
    # Imported here: common.config imports this module, and sampling_params brings grpc (its
    # errors), ~45 ms at every `folio` command's start for a check only the tokenizer makes.
    from common.sampling_params import SamplingParams

    sampling = {k: v for k, v in defaults.given().items() if k != "max_tokens"}
    try:
        SamplingParams(**sampling, max_tokens=defaults.max_tokens).validate()
    except ValueError as exc:
        raise ValueError(f"generation_config's sampling defaults: {exc}") from None
    return defaults
