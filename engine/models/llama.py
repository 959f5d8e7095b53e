"""One model for the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

q/k/v and gate/up are fused into single weights (the loader fills them shard by shard) so each
layer is a handful of large ops. Parameters are created empty: only the loader fills them. This
module never reads files and never allocates the KV cache; attention goes through the backend.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.models.config import ModelConfig


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked layout for bf16 CPU matmuls (what torch.compile's freezing uses):
    about 2x faster at batch 1 and 1.1-1.2x at large batches, with identical results.
    float32 keeps plain F.linear, the exact path the correctness oracle checks."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None) if can_prepack(weight) else None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias=None) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """Weight [sum(output_sizes), in] and optional bias; output_sizes > 1 entry means fused shards."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype, device) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.weight = _empty(sum(output_sizes), in_features, dtype=dtype, device=device)
        self.bias = _empty(sum(output_sizes), dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None

    def finalize_weights(self) -> None:
        self.packed = prepack(self.weight)
        if self.packed is not None:
            # The packed copy is the only one the forward reads; don't hold the weights twice.
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers does it: normalise in float32, cast back, then scale in the model dtype."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var.add_(eps))).to(x.dtype)


def rope_table(config: ModelConfig, dtype: torch.dtype, device) -> torch.Tensor:
    """[max_positions, 2, head_dim]: cos, and sin with its first half negated.

    With the halves of x swapped, x * cos + swapped * signed_sin is transformers'
    x * cos + rotate_half(x) * sin (non-interleaved RoPE), in three ops instead of six.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotates x [T, heads, D] in place; cos and signed_sin are [T, 1, D]."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    x.mul_(cos).addcmul_(swapped, signed_sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, device) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = d**-0.5
        self.backend = backend
        self.qkv_proj = Linear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], config.attention_bias, dtype, device
        )
        self.o_proj = Linear(self.q_size, [config.hidden_size], config.o_proj_bias, dtype, device)
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
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        split = self.q_size + self.kv_size
        # q and k heads side by side, so norm and RoPE are one op each for both.
        qk = qkv[:, :split].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = rms_norm(qk, self.qk_norm_weight, self.eps)
        apply_rope_(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, split:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
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
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.intermediate_size = i = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [i, i], config.mlp_bias, dtype, device)
        self.down_proj = Linear(i, [config.hidden_size], config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = F.silu(gate_up[:, : self.intermediate_size])
        return self.down_proj(act.mul_(gate_up[:, self.intermediate_size :]))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, device) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Updates the residual stream `hidden` in place."""
        hidden.add_(self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta))
        hidden.add_(self.mlp(self.post_attention_layernorm(hidden)))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, device) -> None:
        super().__init__()
        # Bare modules holding one weight keep the checkpoint's names (model.embed_tokens.weight).
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, dtype, device) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    # Checkpoint projection name -> (our fused module, shard index within its output_sizes).
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, backend, dtype, device)
        self.lm_head = nn.Module()
        self.lm_head.weight = (
            self.model.embed_tokens.weight
            if config.tie_word_embeddings
            else _empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        self.lm_head_packed: torch.Tensor | None = None
        self.register_buffer("rope", rope_table(config, dtype, device), persistent=False)

    def finalize_weights(self) -> None:
        """Derives what the forward needs from freshly loaded weights."""
        for module in self.modules():
            if module is not self and hasattr(module, "finalize_weights"):
                module.finalize_weights()
        # The embedding (often tied to lm_head) stays plain for the lookup; logits get a packed copy.
        self.lm_head_packed = prepack(self.lm_head.weight)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """[T] tokens of a ragged batch (decodes first) -> [T, hidden] after the final norm."""
        self.backend.prepare(attn_metadata)
        rope = self.rope[positions]
        cos, sin = rope[:, 0:1], rope[:, 1:2]
        hidden = F.embedding(input_ids, self.model.embed_tokens.weight)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            layer(hidden, cos, sin, kv_cache, attn_metadata)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight, self.lm_head_packed).float()
