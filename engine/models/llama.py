"""One model for the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

q/k/v and gate/up are fused into single weights (the loader fills them shard by shard) so each
layer is a handful of large ops. Parameters are created empty: only the loader fills them. This
module never reads files and never allocates the KV cache; attention goes through the backend.
With tensor parallelism (engine.models.parallel) each rank builds the same model over its share
of heads, MLP rows and vocabulary; with one rank the layers are the plain ones.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, torch_rms_norm
from engine.attention.metadata import AttentionMetadata
from engine.attention.step import attention, running_step
from engine.kernels import cpu_extension
from engine.models.config import ModelConfig
from engine.models.parallel import (
    SINGLE,
    CheckpointSlice,
    TensorParallel,
    all_reduce_,
    embed,
    gather_logits,
    kv_heads_slice,
    scaled,
    split_evenly,
    vocab_slice,
)
from engine.models.quantization import QuantizedWeight, quantize


@dataclass
class RopeInputs:
    """What every layer's rotary embedding reads, gathered once per step."""

    positions: torch.Tensor
    table: torch.Tensor
    cos_sin: tuple[torch.Tensor, torch.Tensor]


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


@dataclass
class Bf16Tiles:
    """A bfloat16 weight [out_features, in] in the tiles of Folio's bf16_linear op
    (engine/kernels/cpu_linear.cpp: AVX-512 BF16 dot products)."""

    tiles: torch.Tensor
    out_features: int

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.folio_linear.bf16_linear(x, self.tiles, bias, self.out_features)


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked layout for CPU matmuls, multiplied through Folio's packed_linear op
    (engine/kernels/cpu_linear.cpp: compiled decode programs can call it), so only where
    Folio's CPU kernels load; float32 only (bfloat16 has tiles of its own: can_tile_bf16). torch's
    F.linear calls MKL, whose small-batch sgemm runs far below these AMD CPUs' bandwidth and no
    faster from ~256 rows (docs/quantization.md); results differ from MKL's by float32 rounding
    (summation order) only."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not cpu_extension.load():
        return False
    return weight.dtype == torch.float32


def can_tile_bf16(weight: torch.Tensor) -> bool:
    """Folio's bf16_linear runs on CPUs with AVX-512 BF16 (elsewhere bfloat16 is not the
    default dtype: it is emulated there), for an even number of input features. Measured
    against oneDNN's bfloat16 kernels on its prepacked weights, it is never slower up to 256
    rows (docs/quantization.md, "bfloat16 on the CPU"), so it serves every batch."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[-1] % 2 == 0
        and cpu_extension.load()
        and torch.ops.folio_linear.cpu_has_avx512_bf16()
    )


def bound_cpu_kernel_caches(capacity: int) -> None:
    """Cap oneDNN's kernel caches (engine.models.loader.CPU_KERNEL_CACHE_CAPACITY says why).

    Both read their capacity from the environment when they first build a kernel, so this must
    run before the first bf16 matmul of the process; values already set are kept.
    """
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


PackedWeight = torch.Tensor | Bf16Tiles | QuantizedWeight


def prepack(weight: torch.Tensor) -> torch.Tensor | Bf16Tiles | None:
    """The weight in the layout the fastest CPU kernel for it reads, or None (F.linear)."""
    if can_tile_bf16(weight):
        return Bf16Tiles(torch.ops.folio_linear.pack_bf16_weight(weight), weight.shape[0])
    return torch.ops.mkldnn._reorder_linear_weight(weight, None) if can_prepack(weight) else None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: PackedWeight | None,
    bias=None,
) -> torch.Tensor:
    if isinstance(packed, QuantizedWeight):
        out = packed.matmul(x)
        return out if bias is None else out.add_(bias)
    if isinstance(packed, Bf16Tiles):
        return packed.matmul(x, bias)
    if packed is not None:
        return torch.ops.folio_linear.packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """Weight [sum(output_sizes), in] and optional bias; output_sizes > 1 entry means fused
    shards. A column-parallel one holds checkpoint_rows of each shard (None: all rows)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype,
        device,
        checkpoint_rows: list[CheckpointSlice] | None = None,
    ) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.checkpoint_rows = checkpoint_rows
        self.weight = _empty(sum(output_sizes), in_features, dtype=dtype, device=device)
        self.bias = _empty(sum(output_sizes), dtype=dtype, device=device) if bias else None
        self.packed: PackedWeight | None = None

    def finalize_weights(self, quantization: str | None = None) -> None:
        self.packed = quantize(self.weight, quantization) if quantization else prepack(self.weight)
        if self.packed is not None:
            # The packed copy is the only one the forward reads; don't hold the weights twice.
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


def column_linear(
    in_features: int,
    shards: list[CheckpointSlice],
    bias: bool,
    dtype,
    device,
    tp: TensorParallel,
) -> Linear:
    """A linear layer over the given output shards (fused when more than one); with several
    ranks it holds only this rank's rows of each."""
    sizes = [s.count for s in shards]
    return Linear(in_features, sizes, bias, dtype, device, shards if tp.size > 1 else None)


class RowParallelLinear(Linear):
    """Holds checkpoint_columns of the input features: each rank's product is partial and an
    all-reduce sums them; the bias (whole on every rank) is added once, after the sum."""

    def __init__(
        self,
        columns: CheckpointSlice,
        out_features: int,
        bias: bool,
        dtype,
        device,
        tp: TensorParallel,
    ) -> None:
        super().__init__(columns.count, [out_features], False, dtype, device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None
        self.checkpoint_columns = columns
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_(linear(x, self.weight, self.packed), self.tp)
        return out if self.bias is None else out.add_(self.bias)


def row_linear(
    columns: CheckpointSlice, out_features: int, bias: bool, dtype, device, tp: TensorParallel
) -> Linear:
    """A linear layer over the given input features: plain with one rank, row-parallel (this
    rank's columns, all-reduced) with several."""
    if tp.size == 1:
        return Linear(columns.full, [out_features], bias, dtype, device)
    return RowParallelLinear(columns, out_features, bias, dtype, device, tp)


class RMSNorm(nn.Module):
    """A norm's weight and epsilon; the backend computes it (fused with the residual add)."""

    def __init__(self, size: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(size, dtype=dtype, device=device)


def rope_table(config: ModelConfig, dtype: torch.dtype, device) -> torch.Tensor:
    """[max_positions, 2, head_dim]: cos, and sin with its first half negated.

    With the halves of x swapped, x * cos + swapped * signed_sin is transformers'
    x * cos + rotate_half(x) * sin (non-interleaved RoPE), in three ops instead of six.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    if config.rope_scaling is not None:  # llama3, the only other type the config admits
        inv_freq = _llama3_inv_freq(inv_freq, config.rope_scaling, config.max_position_embeddings)
    freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, : dim // 2].neg_()
    return torch.stack((emb.cos(), sin), dim=1).to(dtype=dtype, device=device)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_positions: int) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        dtype,
        device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        # Which of the step's KV caches is this layer's.
        self.layer_index = layer_index
        self.head_dim = d = config.head_dim
        q_rows = scaled(split_evenly(config.num_attention_heads, tp), d)
        kv_rows = scaled(kv_heads_slice(config.num_key_value_heads, tp), d)
        self.num_heads = q_rows.count // d
        self.num_kv_heads = kv_rows.count // d
        self.q_size = q_rows.count
        self.kv_size = kv_rows.count
        self.scale = d**-0.5
        self.backend = backend
        self.qkv_proj = column_linear(
            config.hidden_size, [q_rows, kv_rows, kv_rows], config.attention_bias, dtype, device, tp
        )
        self.o_proj = row_linear(q_rows, config.hidden_size, config.o_proj_bias, dtype, device, tp)
        self.eps = config.rms_norm_eps
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
            # Filled by finalize_weights: q_norm's weight for each q head, then k_norm's.
            self.qk_norm_weight: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        split = self.q_size + self.kv_size
        # q and k heads side by side, so norm and RoPE are one op each for both.
        qk = qkv[:, :split].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            assert self.qk_norm_weight is not None, "finalize_weights() was not called"
            qk = torch_rms_norm(qk, self.qk_norm_weight, self.eps)
        self.backend.rotary_(qk, self.num_heads, rope.positions, rope.table, rope.cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, split:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attention(self.backend, q, k, v, self.layer_index, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))

    def finalize_weights(self) -> None:
        if self.qk_norm:
            self.qk_norm_weight = torch.cat(
                (
                    self.q_norm.weight.expand(self.num_heads, self.head_dim),
                    self.k_norm.weight.expand(self.num_kv_heads, self.head_dim),
                )
            )


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype,
        device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        rows = split_evenly(config.intermediate_size, tp)
        self.backend = backend
        self.gate_up_proj = column_linear(
            config.hidden_size, [rows, rows], config.mlp_bias, dtype, device, tp
        )
        self.down_proj = row_linear(rows, config.hidden_size, config.mlp_bias, dtype, device, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        dtype,
        device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.self_attn = LlamaAttention(config, layer_index, backend, dtype, device, tp)
        self.mlp = LlamaMLP(config, backend, dtype, device, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's output, not yet added to the residual stream: each norm
        adds its input to the residual first (one fused op on GPU). Returns (output, residual)."""
        norm = self.backend.rms_norm
        if residual is None:  # first layer: the embeddings are the residual stream
            residual = x
            h = norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            h = norm(x, self.input_layernorm.weight, self.input_layernorm.eps, residual)
        h = self.self_attn(h, rope)
        h = norm(
            h, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps, residual
        )
        return self.mlp(h), residual


class VocabRows(nn.Module):
    """One [vocab rows, hidden] weight under the checkpoint's name (model.embed_tokens.weight,
    lm_head.weight); with several ranks, this rank's rows (checkpoint_rows tells the loader)."""

    def __init__(self, weight: torch.Tensor, checkpoint_rows: list[CheckpointSlice] | None):
        super().__init__()
        self.weight = weight
        self.checkpoint_rows = checkpoint_rows


def vocab_rows(config: ModelConfig, dtype, device, tp: TensorParallel) -> VocabRows:
    rows, padded = vocab_slice(config.vocab_size, tp)
    weight = _empty(padded, config.hidden_size, dtype=dtype, device=device)
    return VocabRows(weight, [rows] if tp.size > 1 else None)


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype,
        device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_rows(config, dtype, device, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, dtype, device, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    # Checkpoint projection name -> (our fused module, shard index within its output_sizes).
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    rope: torch.Tensor  # a buffer: [max positions, 2, rotary dims / 2] cos and sin

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.tp = tp
        self.model = LlamaModel(config, backend, dtype, device, tp)
        # This rank's share of the KV heads: the KV cache's shape.
        self.num_kv_heads = kv_heads_slice(config.num_key_value_heads, tp).count
        self.lm_head = (
            VocabRows(self.model.embed_tokens.weight, None)
            if config.tie_word_embeddings
            else vocab_rows(config, dtype, device, tp)
        )
        self.lm_head_packed: PackedWeight | None = None
        self.register_buffer("rope", rope_table(config, dtype, device), persistent=False)

    def finalize_weights(self, quantization: str | None = None) -> None:
        """Derives what the forward needs from freshly loaded weights; with `quantization`, the
        linear layers are quantized (engine.models.quantization) and the vocabulary projection
        goes to int8."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize_weights(quantization)
            elif module is not self and (finalize := getattr(module, "finalize_weights", None)):
                finalize()
        # The embedding (often tied to lm_head) stays plain for the lookup; logits get a packed
        # copy.
        head = self.lm_head.weight
        self.lm_head_packed = quantize(head, "int8") if quantization else prepack(head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """[T] tokens of a ragged batch (decodes first) -> [T, hidden] after the final norm."""
        with running_step(self.backend, attn_metadata, kv_caches):
            return self.hidden_states(input_ids, positions)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layers, inside a running step (engine.attention.step): the part torch.compile
        compiles (engine.compiled_decode)."""
        table = self.rope[positions]
        rope = RopeInputs(positions, self.rope, (table[:, 0:1], table[:, 1:2]))
        x = embed(input_ids, self.model.embed_tokens.weight, self.tp)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope)
        norm = self.model.norm
        return self.backend.rms_norm(x, norm.weight, norm.eps, residual)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits; with several ranks rank 0 gathers them from every
        rank's vocabulary columns and the other ranks get None."""
        logits = linear(hidden, self.lm_head.weight, self.lm_head_packed)
        if self.tp.size == 1:
            return logits.float()
        gathered = gather_logits(logits, self.config.vocab_size, self.tp)
        return None if gathered is None else gathered.float()
