"""One LoRA adapter read from PEFT's files and checked against the served model.

PEFT saves an adapter as a directory: adapter_config.json (rank r, lora_alpha, use_rslora,
target_modules) and adapter_model.safetensors (per target module, lora_A [r, in] and lora_B
[out, r]). This module reads both with safetensors and json only (never peft itself), checks
every tensor against the model (a target the model lacks, a rank over --max-lora-rank, shapes
of another base model, features it does not serve), and hands back host-memory weights laid out
on Folio's own modules: q/k/v shards of the fused qkv_proj, gate/up of gate_up_proj, o_proj and
down_proj whole. The scaling (alpha / r, or alpha / sqrt(r) with rslora) is folded into B.
Every refusal is an AdapterError naming the problem, never a file's contents. It never puts
weights on a device and never decides which adapters are resident (engine.lora.registry).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names -> (Folio's module in the decoder layer, shard within its fused weight).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_TENSOR = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<name>\w+)\.lora_(?P<ab>[AB])"
    r"(?:\.[\w-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter Folio cannot serve; the message names the problem (and the file or tensor)."""


@dataclass(frozen=True)
class ModuleShape:
    """What a LoRA on one Folio module must look like: its input width and each shard's rows."""

    in_features: int
    shard_rows: tuple[int, ...]


@dataclass
class LoraWeights:
    """One adapter in host memory: per (layer index, Folio module), per shard, (A [r, in],
    B [rows, r] already scaled)."""

    rank: int
    modules: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for shards in self.modules.values()
            for a, b in shards.values()
        )


def load_adapter(
    path: str | Path,
    shapes: dict[tuple[int, str], ModuleShape],
    max_rank: int,
    dtype: torch.dtype,
) -> LoraWeights:
    """The adapter in directory `path`, checked against `shapes` (every LoRA-capable module of
    the model, by (layer, Folio module)); AdapterError naming what is wrong otherwise."""
    directory = Path(path)
    config = _read_config(directory)
    rank, alpha = config["r"], config["lora_alpha"]
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"adapter rank {rank} is over the engine's max_lora_rank {max_rank} "
            "(raise --max-lora-rank)"
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"adapter weights file {WEIGHTS_FILE} is missing in {directory}")
    pairs: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
            found = _TENSOR.search(key)
            if found is None:
                raise AdapterError(
                    f"tensor {key}: not a LoRA A/B weight of a decoder layer's "
                    f"{'/'.join(TARGETS)} (Folio serves LoRA on those modules only)"
                )
            name, layer = found["name"], int(found["layer"])
            module, shard = _folio_module(name, key)
            if (layer, module) not in shapes:
                raise AdapterError(
                    f"tensor {key}: target module {name} of layer {layer} is not in this model"
                )
            pairs.setdefault((layer, module, shard), {})[found["ab"]] = tensors.get_tensor(key)
    out = LoraWeights(rank)
    for (layer, module, shard), ab in sorted(pairs.items()):
        where = f"layer {layer} {module} shard {shard}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        shape = shapes[layer, module]
        want_a = (rank, shape.in_features)
        want_b = (shape.shard_rows[shard], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)}, but this model "
                f"needs {list(want_a)} and {list(want_b)} (rank {rank}): an adapter of another "
                "base model?"
            )
        out.modules.setdefault((layer, module), {})[shard] = (
            a.to(dtype).contiguous(),
            (b.float() * scale).to(dtype).contiguous(),
        )
    if not out.modules:
        raise AdapterError(f"{WEIGHTS_FILE} in {directory} holds no LoRA weights")
    return out


def _folio_module(name: str, key: str) -> tuple[str, int]:
    if name not in TARGETS:
        raise AdapterError(
            f"tensor {key}: target module {name} is not one this model has a LoRA slot for "
            f"({', '.join(TARGETS)})"
        )
    return TARGETS[name]


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist")
    if not path.is_file():
        raise AdapterError(f"adapter config file {CONFIG_FILE} is missing in {directory}")
    try:
        config = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{CONFIG_FILE} in {directory} is not valid JSON ({exc.msg})") from None
    except (OSError, UnicodeDecodeError):
        raise AdapterError(f"{CONFIG_FILE} in {directory} cannot be read") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} in {directory} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {peft_type!r}, Folio serves LORA only")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or isinstance(config.get(key), bool):
            raise AdapterError(f"{CONFIG_FILE}: {key} must be a number")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    for key, used in unsupported.items():
        if used:
            raise AdapterError(f"{CONFIG_FILE}: {key} is set; Folio does not serve it")
    return config
