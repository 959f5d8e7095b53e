"""The model shape the engine needs, parsed from a Hugging Face directory's config.json.

Reads old (transformers 4: top-level rope_theta / rope_scaling) and new (transformers 5:
rope_parameters) layouts into one flat dataclass. It only parses and validates: it must never
load weights or touch a device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Per architecture: does q/k/v carry a bias ("config" = the attention_bias key), does o_proj,
# does the MLP ("config" = the mlp_bias key), and is there a per-head RMSNorm on q and k.
_ARCHITECTURES: dict[str, dict[str, object]] = {
    "LlamaForCausalLM": dict(qkv_bias="config", o_bias="config", mlp_bias="config", qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias="config", o_bias="config", mlp_bias=False, qk_norm=True),
    "Phi3ForCausalLM": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn", "longrope", "dynamic")
# Rope parameters each rope type cannot do without (original_max_position_embeddings may also
# sit at the config's top level, as Phi-3 has it).
_REQUIRED_ROPE_PARAMETERS = {
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
    # The longest context this model serves exactly. For a sliding-window model it is capped
    # at the window: inside it, sliding and full attention are the same computation.
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

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
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
                f"unsupported model architecture {architectures or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = architectures[0]
        traits = _ARCHITECTURES[architecture]

        def trait(name: str, key: str) -> bool:
            value = traits[name]
            return bool(raw.get(key, False)) if value == "config" else bool(value)

        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' is supported"
            )

        rope_theta, rope_scaling = _parse_rope(raw, architecture)
        num_heads = raw["num_attention_heads"]
        max_positions = _served_positions(raw.get("max_position_embeddings", 2048), rope_scaling)
        window = _sliding_window(raw)
        if window is not None and window < max_positions:
            max_positions = window

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


def _sliding_window(raw: dict) -> int | None:
    """The attention window if any layer actually uses one."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    # Mistral has no use_sliding_window key: a window there is always on.
    return window if raw.get("use_sliding_window", True) else None
