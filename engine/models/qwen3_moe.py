"""Qwen3-MoE (and Qwen2-MoE): Qwen's attention (Qwen3's per-head q/k norms, Qwen2's q/k/v
biases, as engine.models.config says) and decoder layers with a mixture of experts on every
sparse layer (engine.layers.moe; Qwen2-MoE's with its gated shared expert) and the dense MLP on
the others (mlp_only_layers, decoder_sparse_step). Their checkpoints name the experts'
projections as the dense MLP's (mlp.experts.N.gate_proj / up_proj / down_proj, mlp.gate,
mlp.shared_expert.*), so Llama's mapping reads them. This module never reads files.
"""

from __future__ import annotations

from typing import ClassVar

from engine.models.llama import LlamaForCausalLM, MlpFactory
from engine.models.mixtral import moe_mlp


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    make_mlp: ClassVar[MlpFactory] = staticmethod(moe_mlp)
