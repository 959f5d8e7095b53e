"""Test helper: LoRA adapters in PEFT's format made with the peft package on a checkpoint
(tests/tiny_models.py's, or the default model), with non-zero B so each changes the model's
tokens; the PEFT model made is the oracle (transformers + peft, float32)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    directory: Path,
    rank: int,
    alpha: float,
    targets: list[str] = ALL_TARGETS,
    rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
):
    """Save an adapter of `rank` on `base_dir`'s model into `directory`; returns the PEFT model
    (float32, eval) to check Folio's tokens against."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(directory)
    return model.eval()
