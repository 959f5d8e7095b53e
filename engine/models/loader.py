"""Builds a model from a Hugging Face safetensors directory (one file or an indexed shard set)
or a GGUF file (engine.models.gguf reads its tensors).

Maps checkpoint names onto our fused layout and fails loudly, naming the weights, when the
checkpoint and the model disagree. A tensor-parallel rank reads only its rows or columns of
each tensor (safetensors slices). It must never download anything: the directory is local.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from common.gguf_file import is_gguf
from engine.layers.attention import get_attention_backend
from engine.layers.linear import bound_cpu_kernel_caches, describe_linears
from engine.layers.moe import SparseMoe
from engine.layers.parallel import (
    SINGLE,
    CheckpointSlice,
    TensorParallel,
    check_tensor_parallel_size,
)
from engine.models.config import ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gguf import load_gguf_weights
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

# Architecture name (config.json "architectures") -> model class.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen3MoeForCausalLM,  # the same block, with its shared expert
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}

logger = logging.getLogger(__name__)

# Entries of oneDNN's two kernel caches (its primitive cache and PyTorch's ideep LRU cache) in
# an engine on CPU; their defaults are 1024 each. Every new batch shape compiles and caches
# kernels, so with the defaults the engine's memory grew by hundreds of MiB under varied load
# and kept growing for as long as new shapes came; at 64 it is flat after a few steps, and
# `folio bench offline` runs as fast (within its noise). An environment value set by the
# operator (ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY) wins.
CPU_KERNEL_CACHE_CAPACITY = 64
# Checkpoint entries that carry no weights we need (old files saved RoPE's inverse frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    attention_backend: str = "auto",
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model of a local directory, or this rank's shard of it; `quantization` ("int8",
    "int4") quantizes its linear layers' weights after loading."""
    path = Path(path)
    gguf = is_gguf(path)
    if gguf and (quantization or tp.size > 1):
        raise ValueError(
            "a GGUF model is served with its own tensor types on one rank: leave quantization "
            f"unset (got {quantization!r}) and the tensor-parallel size 1 (got {tp.size})"
        )
    config = ModelConfig.from_dir(path)
    check_tensor_parallel_size(config.num_attention_heads, config.num_key_value_heads, tp.size)
    model_class = MODEL_REGISTRY.get(config.architecture)
    if model_class is None:
        registered = ", ".join(MODEL_REGISTRY)
        raise ValueError(
            f"no model class for architecture {config.architecture!r}; registered: {registered}"
        )
    if torch.device(device).type == "cpu":
        bound_cpu_kernel_caches(CPU_KERNEL_CACHE_CAPACITY)
    model = model_class(config, get_attention_backend(attention_backend, device), dtype, device, tp)
    if gguf:
        load_gguf_weights(model, path, _our_name)
    else:
        load_weights(model, _checkpoint_files(path))
    model.finalize_weights(quantization)
    logger.info("%s linears, activations %s: %s", path.name, dtype, describe_linears(model))
    return model, config


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Copies every checkpoint tensor into its (possibly fused) parameter, converting dtype."""
    params = dict(model.named_parameters())  # a tied lm_head appears only as embed_tokens
    tied = model.config.tie_word_embeddings
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        module = model.get_submodule(name.rpartition(".")[0])
        sizes = getattr(module, "output_sizes", [None])
        expected.update(
            (name, shard) for shard in (range(len(sizes)) if len(sizes) > 1 else [None])
        )

    loaded: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []
    with ExitStack() as stack:
        opened = [
            stack.enter_context(safe_open(file, framework="pt", device="cpu")) for file in files
        ]
        owner = {key: f for f in opened for key in f.keys()}  # noqa: SIM118 (not iterable)
        for key, f in owner.items():
            if key.endswith(_IGNORED_SUFFIXES) or (tied and key == "lm_head.weight"):
                continue
            split = model.checkpoint_tensors(key, lambda other: owner[other].get_tensor(other))
            sources = [(key, f)] if split is None else [(k, _InMemory(t)) for k, t in split.items()]
            for source_key, source in sources:
                _load_tensor(model, params, source, source_key, loaded, unexpected)

    problems = []
    missing = expected - loaded
    if missing:
        problems.append(
            "missing "
            + ", ".join(sorted(n if s is None else f"{n} (shard {s})" for n, s in missing))
        )
    if unexpected:
        problems.append("unexpected " + ", ".join(sorted(unexpected)))
    if problems:
        raise ValueError("checkpoint does not match the model: " + "; ".join(problems))


def _load_tensor(
    model: LlamaForCausalLM,
    params: dict[str, torch.nn.Parameter],
    f,
    key: str,
    loaded: set[tuple[str, int | None]],
    unexpected: list[str],
) -> None:
    """Checkpoint tensor `key` of `f` into its parameter (or its shards)."""
    name, shard = _our_name(key, model.packed_modules)
    if name not in params:
        if not _another_ranks_expert(model, name):
            unexpected.append(key)
        return
    module = model.get_submodule(name.rpartition(".")[0])
    # A checkpoint tensor named after one of our fused modules (Phi-3's qkv_proj and
    # gate_up_proj) holds all its shards, stacked: each is read as its own.
    sizes = cast(list[int], getattr(module, "output_sizes", [None]))
    stacked = shard is None and len(sizes) > 1
    for part in range(len(sizes)) if stacked else [shard]:
        _load_part(f, key, module, params[name].data, part, stacked, name)
        loaded.add((name, part))


class _InMemory:
    """One tensor a model derived from checkpoint tensors (engine.models.llama's
    checkpoint_tensors), read as a safetensors file's: whole, or in slices (a rank's rows)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.tensor

    def get_slice(self, key: str) -> _InMemory:
        return self

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def _load_part(
    f, key: str, module, param: torch.Tensor, shard: int | None, stacked: bool, name: str
) -> None:
    """Copies checkpoint tensor `key` (or its shard's rows, when `stacked`) into `param` (or
    the rows of its shard `shard`)."""
    target = param
    if shard is not None:
        sizes = cast(list[int], module.output_sizes)
        target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
    tensor = _read(f, key, module, name.endswith(".weight"), shard or 0, stacked)
    if tensor.shape[0] < target.shape[0] and getattr(module, "checkpoint_rows", None):
        # The last vocabulary shard's padding rows: never looked up, logits cut off.
        target[tensor.shape[0] :].zero_()
        target = target[: tensor.shape[0]]
    if tensor.shape != target.shape:
        raise ValueError(
            f"weight {key!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)


def _read(f, key: str, module, is_weight: bool, shard: int, stacked: bool) -> torch.Tensor:
    """The checkpoint tensor, or only the rows (column-parallel layers, vocabulary shards, a
    stacked tensor's shard) or columns (row-parallel weights) this rank holds."""
    rows = getattr(module, "checkpoint_rows", None)
    columns = getattr(module, "checkpoint_columns", None) if is_weight else None
    if stacked:
        # Shard `shard` of the stacked tensor starts after the whole shards before it.
        sizes = [r.full for r in rows] if rows else list(module.output_sizes)
        part = rows[shard] if rows else CheckpointSlice(0, sizes[shard], sizes[shard])
        tensor = f.get_slice(key)
        _check_full(key, tensor.get_shape(), 0, CheckpointSlice(0, 0, sum(sizes)))
        start = sum(sizes[:shard]) + part.start
        return tensor[start : start + part.count]
    if rows is None and columns is None:
        return f.get_tensor(key)
    tensor = f.get_slice(key)
    shape = tensor.get_shape()
    if rows is not None:
        _check_full(key, shape, 0, rows[shard])
        return tensor[rows[shard].start : rows[shard].start + rows[shard].count]
    assert columns is not None
    _check_full(key, shape, 1, columns)
    return tensor[:, columns.start : columns.start + columns.count]


def _check_full(key: str, shape: list[int], dim: int, part: CheckpointSlice) -> None:
    if len(shape) <= dim or shape[dim] != part.full:
        raise ValueError(
            f"weight {key!r} has shape {tuple(shape)}, the model expects {part.full} "
            f"entries along dimension {dim}"
        )


def _another_ranks_expert(model: LlamaForCausalLM, name: str) -> bool:
    """Whether `name` is an expert's weight that expert parallelism gave to another rank."""
    layer, _, rest = name.partition(".experts.")
    if not rest:
        return False
    moe = model.get_submodule(layer)
    return isinstance(moe, SparseMoe) and int(rest.split(".")[0]) not in moe.local_experts


def _our_name(key: str, packed: dict[str, tuple[str, int | None]]) -> tuple[str, int | None]:
    """model.layers.3.self_attn.k_proj.weight -> (model.layers.3.self_attn.qkv_proj.weight, 1);
    every part of the name is mapped (Mixtral's block_sparse_moe.experts.0.w1 -> mlp.experts.0.
    gate_up_proj, shard 0)."""
    parts, shard = key.split("."), None
    for i, part in enumerate(parts):
        if part in packed:
            parts[i], part_shard = packed[part]
            shard = part_shard if part_shard is not None else shard
    return ".".join(parts), shard
