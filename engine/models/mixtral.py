"""Mixtral: Llama's attention and decoder layers, each MLP replaced by a mixture of experts
(engine.layers.moe), the experts' weights read from Mixtral's checkpoint names
(block_sparse_moe.experts.N.w1 / w3 / w2, block_sparse_moe.gate).

`moe_mlp` is the feed-forward block of every mixture-of-experts model here (Qwen2-MoE, Qwen3-MoE
and gpt-oss too): the experts (and a shared expert where the config has one) on sparse layers, the
dense MLP on the others. This module never reads files.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from engine.attention.backend import AttentionBackend
from engine.layers.moe import SparseMoe
from engine.layers.parallel import SINGLE, TensorParallel
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, MlpFactory, dense_mlp


def moe_mlp(
    config: ModelConfig,
    layer_index: int,
    backend: AttentionBackend,
    dtype,
    device,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    moe = config.moe
    assert moe is not None, f"{config.architecture} without experts"
    if not moe.sparse(layer_index):
        return dense_mlp(config, layer_index, backend, dtype, device, tp)
    return SparseMoe(
        config.hidden_size,
        moe.num_experts,
        moe.top_k,
        moe.intermediate_size,
        moe.renormalize,
        backend,
        dtype,
        device,
        tp,
        moe.shared_expert_intermediate_size,
        moe.biases,
        moe.softmax_over_top_k,
        moe.clamped_swiglu,
    )


class MixtralForCausalLM(LlamaForCausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, int | None]]] = {
        **LlamaForCausalLM.packed_modules,
        "block_sparse_moe": ("mlp", None),
        "w1": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "w2": ("down_proj", None),
    }
    make_mlp: ClassVar[MlpFactory] = staticmethod(moe_mlp)
