"""Gemma 3, text only (Gemma3ForCausalLM over a Gemma3TextConfig), composed of engine.layers and
the Llama family's attention and MLP (engine.models.llama).

What Gemma adds: embeddings scaled by sqrt(hidden_size); RMSNorms that scale by 1 + w
(OffsetRMSNorm), on q and k too, and around both halves of each block (input and
post-attention around attention, pre- and post-feedforward around the MLP: each block's output
is normed before it joins the residual stream); the GeLU-tanh gated MLP; attention scaled by
query_pre_attn_scalar; local (sliding-window) layers with their own rope base and global
layers with theirs; final logits soft-capped when the config says so. The windows and the KV
cache groups they need come from the config (engine.models.config's layer_windows). This module
never reads files and never allocates the KV cache.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.layers.norm import OffsetRMSNorm
from engine.layers.parallel import SINGLE, TensorParallel, embed, kv_heads_slice
from engine.layers.rotary import RopeInputs, RotaryEmbedding
from engine.layers.vocab import VocabRows, vocab_rows
from engine.models.config import ModelConfig
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Gemma3Attention(LlamaAttention):
    def finalize_weights(self) -> None:
        super().finalize_weights()
        assert self.qk_norm_weight is not None, "Gemma 3 always norms q and k"
        self.qk_norm_weight = self.qk_norm_weight + 1  # Gemma's norms scale by 1 + w


class Gemma3DecoderLayer(nn.Module):
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
        self.self_attn = Gemma3Attention(config, layer_index, backend, dtype, device, tp)
        self.mlp = LlamaMLP(config, backend, dtype, device, tp)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(size, eps, backend, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(size, eps, backend, dtype, device)
        self.pre_feedforward_layernorm = OffsetRMSNorm(size, eps, backend, dtype, device)
        self.post_feedforward_layernorm = OffsetRMSNorm(size, eps, backend, dtype, device)
        self.sliding = bool(config.layer_windows) and config.layer_windows[layer_index] is not None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer's: x is the previous layer's (normed) output, added to the
        residual stream by this layer's first norm. Returns (output, residual)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope))
        h = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype,
        device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_rows(config.vocab_size, config.hidden_size, dtype, device, tp)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, backend, dtype, device, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, backend, dtype, device)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's loading, finalizing and forward over Gemma 3's layers and ropes."""

    embed_scale: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        # Llama's __init__ would build Llama's layers: the same attributes, Gemma's modules.
        nn.Module.__init__(self)
        self.config = config
        self.backend = backend
        self.tp = tp
        # Llama's methods read only its embed_tokens, layers and norm.
        self.model = Gemma3Model(config, backend, dtype, device, tp)  # type: ignore[assignment]
        self.num_kv_heads = kv_heads_slice(config.num_key_value_heads, tp).count
        self.lm_head = (
            VocabRows(self.model.embed_tokens.weight, None)
            if config.tie_word_embeddings
            else vocab_rows(config.vocab_size, config.hidden_size, dtype, device, tp)
        )
        self.lm_head_packed = None
        self.rotary = RotaryEmbedding(config, backend, dtype, device)
        theta, scaling = config.local_rope or (config.rope_theta, config.rope_scaling)
        local = dataclasses.replace(config, rope_theta=theta, rope_scaling=scaling)
        self.local_rotary = RotaryEmbedding(local, backend, dtype, device)
        # sqrt(hidden_size) in the model's dtype, as transformers rounds it.
        self.register_buffer(
            "embed_scale",
            torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device),
            persistent=False,
        )

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.rotary.step_inputs(positions)
        local_rope = self.local_rotary.step_inputs(positions)
        x = embed(input_ids, self.model.embed_tokens.weight, self.tp) * self.embed_scale
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, local_rope if layer.sliding else rope)
        return self.model.norm(x, residual)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap
