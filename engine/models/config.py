"""The model shape the engine needs, parsed from a Hugging Face directory's config.json.

Reads old (transformers 4: top-level rope_theta / rope_scaling) and new (transformers 5:
rope_parameters) layouts into one flat dataclass. It only parses and validates: it must never
load weights or touch a device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.models.gguf_metadata import gguf_config
from engine.models.moe_config import MoeConfig, parse_moe

# Per architecture: does q/k/v carry a bias ("config" = the attention_bias key), does o_proj,
# does the MLP ("config" = the mlp_bias key), and is there a per-head RMSNorm on q and k.
_ARCHITECTURES: dict[str, dict[str, object]] = {
    "LlamaForCausalLM": dict(qkv_bias="config", o_bias="config", mlp_bias="config", qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias="config", o_bias="config", mlp_bias=False, qk_norm=True),
    # Mixtures of experts (engine.models.moe_config has their experts' shape).
    "MixtralForCausalLM": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen3MoeForCausalLM": dict(qkv_bias="config", o_bias="config", mlp_bias=False, qk_norm=True),
    "Qwen2MoeForCausalLM": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "GptOssForCausalLM": dict(qkv_bias="config", o_bias="config", mlp_bias=False, qk_norm=False),
    "Phi3ForCausalLM": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "Gemma3ForCausalLM": dict(qkv_bias="config", o_bias="config", mlp_bias=False, qk_norm=True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Rope parameters each rope type cannot do without (original_max_position_embeddings may also
# sit at the config's top level, as Phi-3 has it).
_REQUIRED_ROPE_PARAMETERS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
    "dynamic": ("factor",),
}


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; otherwise the rope parameters, "rope_type" included.
    rope_scaling: dict | None
    # The longest context this model serves (its rope's; a sliding window does not cap it).
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on the q/k/v projections (Qwen2 always; Llama/Qwen3 when attention_bias is set).
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    # Per-head RMSNorm on q and k before RoPE (Qwen3).
    qk_norm: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    # The experts of a mixture-of-experts model; None for a dense one.
    moe: MoeConfig | None = None
    # Per layer: its sliding window (a token sees this many positions, itself included), or
    # None for full attention. Empty: every layer attends fully.
    layer_windows: list[int | None] = field(default_factory=list)
    # The gated MLP's activation on the gate: "silu", or "gelu_pytorch_tanh" (Gemma 3).
    hidden_act: str = "silu"
    # Gemma 3: rope of its sliding layers (theta, scaling) where it differs from the full
    # layers'; attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim's; final
    # logits soft-capped as cap * tanh(logits / cap).
    local_rope: tuple[float, dict | None] | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The config of a Hugging Face directory, or of a GGUF file (from its metadata)."""
        path = Path(path)
        if path.suffix == ".gguf":
            return cls.from_dict(gguf_config(path))
        raw = json.loads((path / "config.json").read_text())
        generation = path / "generation_config.json"
        return cls.from_dict(
            raw, json.loads(generation.read_text()) if generation.exists() else None
        )

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {architectures or raw.get('model_type')!r} "
                "(config.json architectures); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = architectures[0]
        traits = _ARCHITECTURES[architecture]

        def trait(name: str, key: str) -> bool:
            value = traits[name]
            return bool(raw.get(key, False)) if value == "config" else bool(value)

        # Gemma names it hidden_activation.
        hidden_act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {hidden_act!r}; supported: "
                f"{', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if raw.get(key):
                raise ValueError(f"unsupported {key} {raw[key]!r}; only null or false")

        rope_params = raw.get("rope_parameters") or {}
        local_rope = None
        if "full_attention" in rope_params:  # one rope per layer type (transformers 5, Gemma 3)
            rope_theta, rope_scaling = _parse_rope(
                dict(raw, rope_parameters=rope_params["full_attention"]), architecture
            )
            local = rope_params.get("sliding_attention") or rope_params["full_attention"]
            local_rope = _parse_rope(dict(raw, rope_parameters=local), architecture)
        else:
            rope_theta, rope_scaling = _parse_rope(raw, architecture)
            if "rope_local_base_freq" in raw:  # Gemma 3 in transformers 4's layout
                local_rope = (float(raw["rope_local_base_freq"]), None)
        num_heads = raw["num_attention_heads"]
        max_positions = _served_positions(raw.get("max_position_embeddings", 2048), rope_scaling)

        eos: list[int] = []
        for source in (raw, generation_config or {}):
            value = source.get("eos_token_id")
            for token in value if isinstance(value, list) else [value]:
                if token is not None and token not in eos:
                    eos.append(token)

        return cls(
            architecture=architecture,
            model_type=raw.get("model_type", ""),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=trait("qkv_bias", "attention_bias"),
            o_proj_bias=trait("o_bias", "attention_bias"),
            mlp_bias=trait("mlp_bias", "mlp_bias"),
            qk_norm=bool(traits["qk_norm"]),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
            moe=parse_moe(raw, architecture),
            layer_windows=_layer_windows(raw, raw["num_hidden_layers"]),
            hidden_act=hidden_act,
            local_rope=local_rope,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
        )


def _parse_rope(raw: dict, architecture: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout, checked."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # as transformers' Phi3Config reads these old names
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} (config.json rope_scaling.rope_type); "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"unsupported partial_rotary_factor {partial!r}; only 1.0 (RoPE over the whole head)"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if "original_max_position_embeddings" in raw:
        params.setdefault(
            "original_max_position_embeddings", raw["original_max_position_embeddings"]
        )
    if rope_type == "dynamic":
        # Dynamic NTK grows its base past the trained context, which it starts from.
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    missing = [key for key in _REQUIRED_ROPE_PARAMETERS[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(
            f"rope type {rope_type!r} needs rope_scaling.{', rope_scaling.'.join(missing)} "
            "in config.json"
        )
    return theta, params


def _served_positions(max_positions: int, rope: dict | None) -> int:
    """The longest context the model's rope serves: YaRN's and dynamic NTK's extend the
    original context by their factor (as vLLM derives it); the others serve
    max_position_embeddings."""
    if rope is not None and rope["rope_type"] in ("yarn", "dynamic") and rope.get("factor"):
        return max(max_positions, int(rope["original_max_position_embeddings"] * rope["factor"]))
    return max_positions


def _layer_windows(raw: dict, num_layers: int) -> list[int | None]:
    """Each layer's sliding window, as transformers reads the config: `layer_types` when it is
    there; else Qwen2/Qwen3's use_sliding_window (layers from max_window_layers on slide),
    Gemma 3's sliding_window_pattern (every pattern-th layer attends fully), or, as Mistral and
    Phi-3 have it, a window on every layer."""
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return [None] * num_layers
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        if "use_sliding_window" in raw:
            first = raw.get("max_window_layers", 28)  # transformers' default
            layer_types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
        elif "sliding_window_pattern" in raw or "_sliding_window_pattern" in raw:
            pattern = raw.get("sliding_window_pattern") or raw["_sliding_window_pattern"]
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)
            ]
        else:
            layer_types = ["sliding_attention"] * num_layers
    if len(layer_types) != num_layers or not set(layer_types) <= set(_LAYER_TYPES):
        raise ValueError(
            f"layer_types must name each of the {num_layers} layers one of "
            f"{', '.join(_LAYER_TYPES)}; got {layer_types!r}"
        )
    return [window if kind == "sliding_attention" else None for kind in layer_types]
