"""Reads a GGUF file's tensors (llama.cpp's format) as they are into Folio's model, without
converting the file to anything first (engine.models.gguf_metadata reads its config).

Llama-family files (`general.architecture` llama, as SmolLM2's are; qwen2 with its q/k/v biases;
qwen3 with its q/k norms; gemma3, whose norms the converter stores as 1 + w: the load takes the
1 off). Tensor types:
F32, F16 and BF16 are read as they are; Q4_0, Q4_1 and Q4_K go straight into Folio's int4
layout (engine.layers.quantization: groups of 32 with a scale and a minimum, two codes to a byte
in Q4_1's order), without rounding: Q4_1's blocks are copied bit for bit, Q4_0's scale d becomes
a scale d with minimum -8d, exact in float16, and Q4_K's groups of 32 keep their codes (moved
into Q4_1's order) with scales d * sc and minimums -dmin * m in float32, which float16 would
round (a layer holding Q4_K has all its groups' scales in float32). Q8_0 and Q6_K go into
Folio's grouped int8 layout (int8 codes with a scale per group) where Folio's kernels take the
model's dtype (float32 on an AVX2 CPU), without rounding: Q8_0's blocks are copied bit for bit
(groups of 32, float16 d), Q6_K's sub-blocks become groups of 16 of codes q - 32 with float32
scales d * sc (a layer holding Q6_K has groups of 16 throughout: a Q8_0 part's scale is then
kept for each half of its block). So is the vocabulary's tensor: the token embedding looks up
and dequantizes only the rows it needs, and a tied one is the vocabulary projection too, one
copy for both. A fused layer mixing the int4 and int8 kinds (a Q4_K_M file's q and k in Q4_K, v
in Q6_K) keeps each run of parts in its own layout, its product the parts' side by side
(engine.layers.quantization.PartsWeight), on Folio's kernels; a layer with a part of another
type is read as floats. Elsewhere (another dtype) Q8_0 and Q6_K are dequantized exactly into
float32 (so are a mixed layer's parts), as are Q5_0, Q5_1 and Q5_K (engine.models.gguf_dequant
says why these fit no integer layout exactly).
Any other type is refused, naming it and the tensor, before anything is loaded. llama.cpp's
converter permutes the rows of Q and K of a llama file for its RoPE (pairs of adjacent features
rotated together): the load undoes it (qwen2's and qwen3's rotate halves, as Hugging Face's do,
and are written as they are). This module never writes files and never quantizes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from common.gguf_file import read_gguf
from engine.layers.linear import Linear, folio_quant_kernels
from engine.layers.quantization import (
    INT4_GROUP_SIZE,
    QuantizedWeight,
    grouped_int8_weight,
    int4_weight,
    parts_weight,
)
from engine.layers.vocab import VocabRows
from engine.models.gguf_dequant import BLOCK_BYTES, dequantize_blocks, q4_k_groups, q6_k_groups

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

Q = GGMLQuantizationType
# The tensor types Folio reads, and how: as floats (exactly), or as int4 codes.
# Dequantized by engine.models.gguf_dequant.
BLOCK_TYPES = frozenset({Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0}) | BLOCK_TYPES
# Read as Folio's int4 weights where every part of a linear layer is one of these (a Q4_K
# tensor elsewhere, the embedding's say, is read as floats).
INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
# Read as Folio's grouped int8 weights where every part of a linear layer (or the vocabulary's
# tensor) is one of these and Folio's kernels take the model's dtype; as floats elsewhere.
INT8_TYPES = frozenset({Q.Q8_0, Q.Q6_K})
Q8_0_BLOCK_BYTES = 2 + 32
READ_TYPES = ", ".join(t.name for t in sorted(FLOAT_TYPES | INT4_TYPES))

# GGUF tensor names (llama.cpp's) -> Hugging Face's, per layer and global.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The tensors llama.cpp's converter permutes in a llama file.
_ROPE_PERMUTED = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
# Gemma 3's: the norms after attention and around the MLP (its ffn_norm is the one before it).
_GEMMA3_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class _Part:
    """One GGUF tensor bound for (a shard of) one of the model's parameters."""

    gguf_name: str
    type: GGMLQuantizationType
    rows: np.ndarray  # [out, in] floats, or [out, bytes] blocks, rows in Hugging Face's order


def load_gguf_weights(
    model: LlamaForCausalLM,
    path: str | Path,
    our_name: Callable[[str, dict[str, tuple[str, int | None]]], tuple[str, int | None]],
) -> None:
    """Copies every tensor of the GGUF into `model` (built from gguf_config's config);
    `our_name` maps a Hugging Face name to (parameter, shard) as engine.models.loader does.
    Linear layers whose every part is Q4_0/Q4_1/Q4_K get their int4 weights here (on the CPU),
    those whose every part is Q8_0/Q6_K their grouped int8 weights (on Folio's kernels), as do
    the vocabulary's rows (model.lm_head_packed, and the embedding's lookup), and those mixing
    the two kinds a parts weight of both (on Folio's kernels); model.finalize_weights keeps
    them."""
    reader = read_gguf(path)
    for tensor in reader.tensors:
        if tensor.tensor_type not in FLOAT_TYPES | INT4_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which Folio "
                f"does not read (it reads {READ_TYPES})"
            )
    config = model.config
    params = dict(model.named_parameters())
    parts: dict[str, dict[int | None, _Part]] = {}
    unexpected = []
    gemma3 = config.model_type == "gemma3"
    for tensor in reader.tensors:
        hf_name = _hf_name(tensor.name, _GEMMA3_TENSORS if gemma3 else _LAYER_TENSORS)
        if hf_name is None or (config.tie_word_embeddings and hf_name == "lm_head.weight"):
            unexpected.append(tensor.name)
            continue
        name, shard = our_name(hf_name, model.packed_modules)
        if name not in params:
            unexpected.append(tensor.name)
            continue
        rows = np.asarray(tensor.data)
        if config.model_type == "llama" and hf_name.endswith(_ROPE_PERMUTED):
            q = ".q_proj." in hf_name
            heads = config.num_attention_heads if q else config.num_key_value_heads
            rows = _unpermute_rope_rows(rows, heads)
        parts.setdefault(name, {})[shard] = _Part(tensor.name, tensor.tensor_type, rows)

    missing = _missing(model, params, parts)
    if missing or unexpected:
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unexpected {', '.join(sorted(unexpected))}"] if unexpected else []
        raise ValueError(f"GGUF {str(path)!r} does not match the model: " + "; ".join(problems))
    for name, shards in parts.items():
        module = model.get_submodule(name.rpartition(".")[0])
        param = params[name]
        types = {p.type for p in shards.values()}
        ordered = [shards[s] for s in sorted(shards, key=lambda s: s or 0)]
        on_cpu = param.device.type == "cpu"
        if isinstance(module, Linear) and name.endswith(".weight") and on_cpu:
            packed = _integer_weight(ordered, param)
            if packed is not None:
                module.packed = packed
                param.data = param.data.new_empty(0)  # the integer copy is the only one read
                continue
        if (
            isinstance(module, VocabRows)
            and types <= INT8_TYPES
            and folio_quant_kernels(param.dtype, param.device)
        ):
            _load_vocabulary(model, module, _checked(_grouped_int8(ordered), ordered, param))
            continue
        for shard, part in shards.items():
            target = param.data
            if shard is not None:
                sizes = cast(list[int], module.output_sizes)
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            values = torch.from_numpy(_as_float32(part))
            if gemma3 and name.endswith("norm.weight"):
                values -= 1  # the converter's 1 + w
            if values.shape != target.shape:
                raise ValueError(
                    f"GGUF tensor {part.gguf_name!r} has shape {tuple(values.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            target.copy_(values)


def _load_vocabulary(model: LlamaForCausalLM, rows: VocabRows, weight: QuantizedWeight) -> None:
    """The vocabulary's Q8_0/Q6_K rows as grouped int8, the only copy: the embedding looks rows
    up in it, the vocabulary projection (the tied embedding, or lm_head) multiplies by it."""
    if rows is model.model.embed_tokens:
        rows.quantized = weight
    if rows is model.lm_head or model.config.tie_word_embeddings:
        model.lm_head_packed = weight
    rows.weight.data = rows.weight.data.new_empty(0)


def _integer_weight(parts: list[_Part], param: torch.Tensor) -> QuantizedWeight | None:
    """A linear layer's parts (in the fused layer's order) as one integer weight, where their
    types allow: all Q4_0/Q4_1/Q4_K int4 (Folio's kernels, or torch's for another dtype), all
    Q8_0/Q6_K grouped int8, or a mix of the two a parts weight, each run of parts of one kind
    in its own layout (both on Folio's kernels only); None where the layer is read as floats."""
    types = {part.type for part in parts}
    folio = folio_quant_kernels(param.dtype, param.device)
    if types <= INT4_TYPES:
        return _checked(_int4(parts, param.dtype, folio), parts, param)
    if not folio or not types <= INT4_TYPES | INT8_TYPES:
        return None
    if types <= INT8_TYPES:
        return _checked(_grouped_int8(parts), parts, param)
    runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.type in INT4_TYPES)]
    weight = parts_weight(
        [
            _int4(run, param.dtype, folio) if run[0].type in INT4_TYPES else _grouped_int8(run)
            for run in runs
        ]
    )
    return _checked(weight, parts, param)


def _checked(weight: QuantizedWeight, parts: list[_Part], param: torch.Tensor) -> QuantizedWeight:
    """`weight`, made of `parts`, where it has the shape of the model's parameter."""
    if weight.shape != tuple(param.shape):
        names = ", ".join(p.gguf_name for p in parts)
        raise ValueError(
            f"GGUF tensors {names} hold {weight.shape[0]} rows of {weight.shape[1]} weights, "
            f"the model expects {tuple(param.shape)}"
        )
    return weight


def _grouped_int8(parts: list[_Part]) -> QuantizedWeight:
    """Q8_0 blocks (a float16 d, then 32 int8 codes) or Q6_K super-blocks as one grouped int8
    weight, the parts' rows stacked as the fused layer orders them: groups of 32 with Q8_0's
    float16 scales as they are, or, with any Q6_K part, groups of 16 with float32 scales (a
    Q8_0 block's d for both its halves)."""
    halves = any(part.type == Q.Q6_K for part in parts)
    codes, scales = [], []
    for part in parts:
        # A copy: the file's memory map is read-only, which torch does not take.
        rows = torch.from_numpy(part.rows.copy())
        size = BLOCK_BYTES["Q6_K"] if part.type == Q.Q6_K else Q8_0_BLOCK_BYTES
        if rows.dim() != 2 or rows.shape[-1] % size:
            raise ValueError(
                f"GGUF tensor {part.gguf_name!r} does not hold whole {part.type.name} blocks"
            )
        if part.type == Q.Q6_K:
            q, scale = q6_k_groups(rows)
        else:
            blocks = rows.view(rows.shape[0], -1, size)
            scale = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
            q = blocks[..., 2:].contiguous().view(torch.int8).flatten(1)
            if halves:
                scale = scale.float().repeat_interleave(2, dim=1)
        codes.append(q)
        scales.append(scale)
    return grouped_int8_weight(torch.cat(codes), torch.cat(scales))


def _q4_k_as_int4(part: _Part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K part's codes in Q4_1's order ([rows, groups, 16]: in each group of 32, byte i holds
    code i low and code i + 16 high) and its groups' float32 scales and minimums ([rows,
    groups])."""
    # A copy: the file's memory map is read-only, which torch does not take.
    rows = torch.from_numpy(part.rows.copy())
    if rows.shape[-1] % BLOCK_BYTES["Q4_K"]:
        raise ValueError(f"GGUF tensor {part.gguf_name!r} does not hold whole Q4_K blocks")
    q, scale, minimum = q4_k_groups(rows)
    halves = q.view(q.shape[0], -1, 2, INT4_GROUP_SIZE // 2)
    return halves[:, :, 0] | (halves[:, :, 1] << 4), scale, minimum


def _hf_name(gguf_name: str, layer_tensors: dict[str, str]) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    blk, layer, kind, suffix = [*gguf_name.split("."), "", "", ""][:4]
    if blk != "blk" or not layer.isdigit() or kind not in layer_tensors:
        return None
    if suffix not in ("weight", "bias"):  # (llama.cpp's names end in one or the other)
        return None
    return f"model.layers.{layer}.{layer_tensors[kind]}.{suffix}"


def _missing(model: LlamaForCausalLM, params: dict, parts: dict) -> list[str]:
    missing = []
    for name in params:
        sizes = getattr(model.get_submodule(name.rpartition(".")[0]), "output_sizes", [None])
        for shard in range(len(sizes)) if len(sizes) > 1 else [None]:
            if shard not in parts.get(name, {}):
                missing.append(name if shard is None else f"{name} (shard {shard})")
    return missing


def _unpermute_rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's row order of a Q or K weight (or bias) from llama.cpp's: the converter
    moved row i + j * head_dim / 2 of each head to row 2 * i + j (j in 0, 1); rows are whole
    quantized blocks' rows too, so this reorders any type."""
    head_dim = rows.shape[0] // heads
    grouped = rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(rows.shape))


def _as_float32(part: _Part) -> np.ndarray:
    """The part's values in float32, exactly (every type read as floats fits float32)."""
    if part.type == Q.F32:
        return np.array(part.rows, dtype=np.float32)
    if part.type == Q.F16:
        return part.rows.astype(np.float32)
    if part.type in BLOCK_TYPES:
        # A copy: the file's memory map is read-only, which torch does not take.
        return dequantize_blocks(torch.from_numpy(part.rows.copy()), part.type.name).numpy()
    return dequantize(part.rows, part.type)


def _int4(parts: list[_Part], dtype: torch.dtype, folio_kernels: bool) -> QuantizedWeight:
    """Q4_0/Q4_1 blocks (rows of 2-byte float16 d, for Q4_1 a float16 m, then 16 bytes of
    codes) or Q4_K super-blocks as Folio's int4 weight for activations of `dtype`, the parts'
    rows stacked as the fused layer orders them."""
    codes, scales, minimums = [], [], []
    for part in parts:
        if part.type == Q.Q4_K:
            nibbles, scale_k, minimum_k = _q4_k_as_int4(part)
            codes.append(nibbles.numpy())
            scales.append(scale_k)
            minimums.append(minimum_k)
            continue
        header = 4 if part.type == Q.Q4_1 else 2
        blocks = part.rows.reshape(part.rows.shape[0], -1, header + INT4_GROUP_SIZE // 2)
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        if part.type == Q.Q4_1:
            minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        else:  # w = d * (q - 8) = d * q + (-8 d): a power-of-two multiple, exact in float16
            with np.errstate(over="ignore"):
                minimum = scale * np.float16(-8)
            if not np.isfinite(minimum).all():
                raise ValueError(f"GGUF tensor {part.gguf_name!r}: a Q4_0 scale overflows -8 d")
        codes.append(blocks[..., header:])  # [out, groups, 16], read in place
        scales.append(torch.from_numpy(scale.astype(np.float32)))
        minimums.append(torch.from_numpy(minimum.astype(np.float32)))
    exact_in_half = all(part.type != Q.Q4_K for part in parts)
    return int4_weight(
        # One copy of the parts' codes, stacked; the kernels' order is one more pass.
        torch.from_numpy(np.concatenate(codes)),
        torch.cat(scales),
        torch.cat(minimums),
        dtype,
        folio_kernels,
        group_dtype=torch.float16 if exact_in_half else torch.float32,
    )
