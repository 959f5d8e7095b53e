"""Test helper: turn a tiny checkpoint (tests/tiny_models.py) into an embedding model the way
sentence-transformers packages one (modules.json, 1_Pooling/config.json, 2_Normalize), and the
reference embedding of a prompt from transformers' hidden states with the same pooling."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Our pooling type -> sentence-transformers' Pooling mode.
ST_MODES = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


def write_sentence_transformers(directory: Path, pooling: str) -> Path:
    """Add a sentence-transformers pipeline (Transformer, Pooling with `pooling`, Normalize) to
    a model directory; returns it."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    config = {mode: mode == ST_MODES[pooling] for mode in ST_MODES.values()}
    config |= {"pooling_mode_max_tokens": False, "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    return directory


def reference_embedding(reference, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of `ids`, pooled and
    L2-normalised, in float32."""
    with torch.no_grad():
        hidden = reference.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1)


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))
