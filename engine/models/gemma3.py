"""Gemma 3, text only (Gemma3ForCausalLM over a Gemma3TextConfig), composed of engine.layers and
the Llama family's decoder layer, attention and MLP (engine.models.llama), which it specializes.

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

from engine.attention.backend import AttentionBackend
from engine.layers.norm import OffsetRMSNorm
from engine.layers.parallel import SINGLE, TensorParallel
from engine.layers.rotary import RopeInputs, RotaryEmbedding
from engine.models.config import ModelConfig
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, MlpFactory


class Gemma3Attention(LlamaAttention):
    def finalize_weights(self) -> None:
        super().finalize_weights()
        assert self.qk_norm_weight is not None, "Gemma 3 always norms q and k"
        self.qk_norm_weight = self.qk_norm_weight + 1  # Gemma's norms scale by 1 + w


class Gemma3DecoderLayer(LlamaDecoderLayer):
    attention_class = Gemma3Attention
    norm_class = OffsetRMSNorm

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        dtype,
        device,
        tp: TensorParallel = SINGLE,
        make_mlp: MlpFactory | None = None,
    ) -> None:
        super().__init__(config, layer_index, backend, dtype, device, tp, make_mlp)
        size, eps = config.hidden_size, config.rms_norm_eps
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


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's loading, finalizing and forward over Gemma 3's layers and ropes."""

    decoder_layer = Gemma3DecoderLayer
    embed_scale: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(config, backend, dtype, device, tp)
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
        x = self.model.embed_tokens.lookup(input_ids, self.tp) * self.embed_scale
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
