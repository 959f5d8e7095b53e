"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) and decoder layers with a mixture of
experts on every sparse layer (engine.layers.moe) and the dense MLP on the others
(mlp_only_layers, decoder_sparse_step). Its checkpoint names the experts' projections as the
dense MLP's (mlp.experts.N.gate_proj / up_proj / down_proj, mlp.gate), so Llama's mapping reads
them. This module never reads files.
"""

from __future__ import annotations

from typing import ClassVar

from engine.models.llama import LlamaForCausalLM, MlpFactory
from engine.models.mixtral import moe_mlp


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    make_mlp: ClassVar[MlpFactory] = staticmethod(moe_mlp)
