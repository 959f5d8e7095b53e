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
        """The defaults that are set, by name (for logs and tests)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}


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


def read_sampling_defaults(model_path: Path, setting: str) -> SamplingDefaults:
    """The defaults --generation-config `setting` gives for the model at `model_path` (a
    directory, or a GGUF file, which carries none)."""
    check_setting(setting)
    if setting in NO_DEFAULTS_SETTINGS:
        return SamplingDefaults()
    directory = model_path if setting == MODEL_SETTING else Path(setting).expanduser()
    path = directory / FILE_NAME
    if not path.is_file():
        return SamplingDefaults()
    config = json.loads(path.read_text())

    def number(key: str) -> float | None:
        value = config.get(key)
        # bool is an int to Python; a file's true is no temperature.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value)

    def integer(key: str) -> int | None:
        value = number(key)
        return None if value is None else int(value)

    return SamplingDefaults(
        temperature=number("temperature"),
        top_p=number("top_p"),
        top_k=integer("top_k"),
        min_p=number("min_p"),
        repetition_penalty=number("repetition_penalty"),
        max_tokens=integer("max_new_tokens"),
    )
