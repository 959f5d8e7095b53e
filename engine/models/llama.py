"""One model for the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache,
composed of engine.layers.

q/k/v and gate/up are fused into single weights (the loader fills them shard by shard) so each
layer is a handful of large ops. Parameters are created empty: only the loader fills them. This
module never reads files, never allocates the KV cache and never chooses a kernel (the layers
do); attention goes through the attention front (engine.layers.attention). With tensor
parallelism (engine.layers.parallel) each rank builds the same model over its share of heads,
MLP rows and vocabulary; with one rank the layers are the plain ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.step import running_step
from engine.layers.activation import gated_activation
from engine.layers.attention import Attention
from engine.layers.linear import (
    Linear,
    PackedWeight,
    column_linear,
    linear,
    pack_weight,
    row_linear,
)
from engine.layers.norm import RMSNorm
from engine.layers.parallel import (
    SINGLE,
    TensorParallel,
    gather_logits,
    kv_heads_slice,
    scaled,
    split_evenly,
)
from engine.layers.quantization import QuantizedWeight
from engine.layers.rotary import RopeInputs, RotaryEmbedding
from engine.layers.vocab import VocabRows, vocab_rows
from engine.models.config import ModelConfig


class LlamaAttention(nn.Module):
    # Whether each query head has an attention sink (a subclass's: gpt-oss's).
    attention_sinks: ClassVar[bool] = False

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
        self.head_dim = d = config.head_dim
        q_rows = scaled(split_evenly(config.num_attention_heads, tp), d)
        kv_rows = scaled(kv_heads_slice(config.num_key_value_heads, tp), d)
        self.num_heads = q_rows.count // d
        self.num_kv_heads = kv_rows.count // d
        self.q_size = q_rows.count
        self.kv_size = kv_rows.count
        self.backend = backend
        # Gemma 3 scales by query_pre_attn_scalar, the others by the head size; a sliding
        # layer's window comes from the config (engine.models.config's layer_windows).
        scale = (config.query_pre_attn_scalar or d) ** -0.5
        window = config.layer_windows[layer_index] if config.layer_windows else None
        sink_heads = split_evenly(config.num_attention_heads, tp) if self.attention_sinks else None
        self.attn = Attention(backend, layer_index, scale, window, sink_heads, dtype, device)
        self.qkv_proj = column_linear(
            config.hidden_size, [q_rows, kv_rows, kv_rows], config.attention_bias, dtype, device, tp
        )
        self.o_proj = row_linear(q_rows, config.hidden_size, config.o_proj_bias, dtype, device, tp)
        self.eps = config.rms_norm_eps
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, backend, dtype, device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, backend, dtype, device)
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
            qk = self.backend.rms_norm(qk, self.qk_norm_weight, self.eps)
        rope.rotate_(qk, self.num_heads)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, split:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v)
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
        self.gate_up_proj = column_linear(
            config.hidden_size, [rows, rows], config.mlp_bias, dtype, device, tp
        )
        self.act = gated_activation(config.hidden_act, backend)
        self.down_proj = row_linear(rows, config.hidden_size, config.mlp_bias, dtype, device, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


# A decoder layer's feed-forward block, from (config, layer_index, backend, dtype, device, tp):
# the dense gated MLP here; mixture-of-experts models (engine.models.mixtral, qwen3_moe) pass
# their own.
MlpFactory = Callable[..., nn.Module]


def dense_mlp(
    config: ModelConfig,
    layer_index: int,
    backend: AttentionBackend,
    dtype,
    device,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    return LlamaMLP(config, backend, dtype, device, tp)


class LlamaDecoderLayer(nn.Module):
    # Its attention and norms (a subclass's own: Gemma 3's).
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

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
        super().__init__()
        self.self_attn = self.attention_class(config, layer_index, backend, dtype, device, tp)
        self.mlp = (make_mlp or dense_mlp)(config, layer_index, backend, dtype, device, tp)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = self.norm_class(size, eps, backend, dtype, device)
        self.post_attention_layernorm = self.norm_class(size, eps, backend, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's output, not yet added to the residual stream: each norm
        adds its input to the residual first (one fused op on GPU). Returns (output, residual)."""
        if residual is None:  # first layer: the embeddings are the residual stream
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype,
        device,
        tp: TensorParallel = SINGLE,
        make_mlp: MlpFactory | None = None,
        layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_rows(config.vocab_size, config.hidden_size, dtype, device, tp)
        self.layers = nn.ModuleList(
            layer_class(config, i, backend, dtype, device, tp, make_mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = layer_class.norm_class(
            config.hidden_size, config.rms_norm_eps, backend, dtype, device
        )


class LlamaForCausalLM(nn.Module):
    # Checkpoint module name -> (our module, shard index within its output_sizes, or None for a
    # module only renamed).
    packed_modules: ClassVar[dict[str, tuple[str, int | None]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Each decoder layer's feed-forward block (a subclass's own for its experts), and the
    # layer itself (Gemma 3's own).
    make_mlp: ClassVar[MlpFactory] = staticmethod(dense_mlp)
    decoder_layer: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

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
        self.model = LlamaModel(
            config, backend, dtype, device, tp, self.make_mlp, self.decoder_layer
        )
        # This rank's share of the KV heads: the KV cache's shape.
        self.num_kv_heads = kv_heads_slice(config.num_key_value_heads, tp).count
        self.lm_head = (
            VocabRows(self.model.embed_tokens.weight, None)
            if config.tie_word_embeddings
            else vocab_rows(config.vocab_size, config.hidden_size, dtype, device, tp)
        )
        self.lm_head_packed: PackedWeight | None = None
        self.rotary = RotaryEmbedding(config, backend, dtype, device)

    def checkpoint_tensors(
        self, key: str, read: Callable[[str], torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """The tensors checkpoint tensor `key` stands for, under names packed_modules maps, where
        a checkpoint stacks or packs several in one (gpt-oss's experts; `read` reads any
        checkpoint tensor); None (every tensor here): `key` is read as it is."""
        return None

    def finalize_weights(self, quantization: str | None = None) -> None:
        """Derives what the forward needs from freshly loaded weights; with `quantization`, the
        linear layers are quantized (engine.layers.quantization) and the vocabulary projection
        goes to int8."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize_weights(quantization)
            elif module is not self and (finalize := getattr(module, "finalize_weights", None)):
                finalize()
        # The embedding (often tied to lm_head) stays plain for the lookup; logits get a packed
        # copy, unless the vocabulary came quantized (a GGUF's Q8_0: kept as it came).
        if not isinstance(self.lm_head_packed, QuantizedWeight):
            head = self.lm_head.weight
            self.lm_head_packed = pack_weight(head, "int8" if quantization else None)

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
        rope = self.rotary.step_inputs(positions)
        x = self.model.embed_tokens.lookup(input_ids, self.tp)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope)
        return self.model.norm(x, residual)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits; with several ranks rank 0 gathers them from every
        rank's vocabulary columns and the other ranks get None."""
        logits = linear(hidden, self.lm_head.weight, self.lm_head_packed)
        if self.tp.size == 1:
            return logits.float()
        gathered = gather_logits(logits, self.config.vocab_size, self.tp)
        return None if gathered is None else gathered.float()
