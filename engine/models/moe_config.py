"""The mixture-of-experts part of a model's shape, parsed from config.json: how many experts,
how many each token goes to, how their weights are normalised, which layers are sparse, how
large a shared expert is.

Reads the keys Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss write (num_local_experts or num_experts,
num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers,
shared_expert_intermediate_size, swiglu_alpha, swiglu_limit) and refuses, naming the key, the
routing variants Folio does not implement (DeepSeek's sigmoid scoring and grouped top-k, scaled
routed weights). Like engine.models.config it only parses and validates: it must never import torch
or touch a weight.
"""

from __future__ import annotations

from dataclasses import dataclass

# Routing keys other MoE families write, with the one value each that means "as Mixtral does".
_ROUTING_DEFAULTS: dict[str, object] = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
}


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    # Experts per token.
    top_k: int
    # Rows of each expert's gate and up projections.
    intermediate_size: int
    # Whether each token's top-k softmax weights are divided by their sum (Mixtral always;
    # Qwen3-MoE when norm_topk_prob is set), or left as the softmax over all experts gave them.
    renormalize: bool
    # Layers with a dense MLP instead of experts (Qwen3-MoE's mlp_only_layers and
    # decoder_sparse_step).
    dense_layers: frozenset[int]
    # Rows of the shared expert every token also goes through, its output scaled by a sigmoid
    # gate (Qwen2-MoE); 0 for none.
    shared_expert_intermediate_size: int = 0
    # gpt-oss: a bias on the router and on every expert projection; the router's softmax taken
    # over its top-k logits (the same weights as renormalising, in another order of rounding);
    # the experts' clamped SwiGLU as (alpha, limit) instead of SiLU (engine.layers.activation).
    biases: bool = False
    softmax_over_top_k: bool = False
    clamped_swiglu: tuple[float, float] | None = None

    def sparse(self, layer_index: int) -> bool:
        return layer_index not in self.dense_layers


def parse_moe(raw: dict, architecture: str) -> MoeConfig | None:
    """The MoE shape of a Mixtral, Qwen2-MoE, Qwen3-MoE or gpt-oss config; None for the dense
    architectures."""
    shared = 0
    gpt_oss = architecture == "GptOssForCausalLM"
    if architecture == "MixtralForCausalLM" or gpt_oss:
        renormalize = True
        size = raw["intermediate_size"]
    elif architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        renormalize = bool(raw.get("norm_topk_prob", False))
        size = raw["moe_intermediate_size"]
        if architecture == "Qwen2MoeForCausalLM":
            shared = raw.get("shared_expert_intermediate_size") or 0
    else:
        return None
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":  # what the experts (and the fused kernel) compute
        raise ValueError(
            f"unsupported hidden_act {activation!r} for a mixture of experts; only 'silu'"
        )
    for key, value in _ROUTING_DEFAULTS.items():
        if key in raw and raw[key] not in (None, value):
            raise ValueError(
                f"unsupported MoE routing {key}={raw[key]!r}; Folio routes with {key}={value!r} "
                f"only ({architecture})"
            )
    num_experts = raw.get("num_local_experts") or raw.get("num_experts")
    if not num_experts:
        raise ValueError(f"{architecture} config has no num_local_experts / num_experts")
    top_k = raw.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"num_experts_per_tok must be between 1 and the {num_experts} experts, got {top_k}"
        )
    num_layers = raw["num_hidden_layers"]
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or [])
    dense.update(i for i in range(num_layers) if (i + 1) % step)
    return MoeConfig(
        num_experts,
        top_k,
        size,
        renormalize,
        frozenset(dense),
        shared,
        biases=gpt_oss,
        softmax_over_top_k=gpt_oss,
        clamped_swiglu=(
            (float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0)))
            if gpt_oss
            else None
        ),
    )
