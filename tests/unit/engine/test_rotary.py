"""Every rope type's frequencies and attention factor equal transformers' rope init functions
(transformers.modeling_rope_utils) for the same config, position by position where transformers
recomputes them from the sequence's length (longrope, dynamic); the table's cos and sin carry
the attention factor as transformers' rotary embedding applies it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.layers.rotary import ROPE_TYPES, rope_frequencies, rope_table
from engine.models.config import SUPPORTED_ROPE_TYPES, ModelConfig
from tiny_models import VARIANTS

SHAPE = dict(
    vocab_size=10, hidden_size=64, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4
)


def both(config_class, **kwargs) -> tuple[Any, ModelConfig]:
    """transformers' config and ours, from the same config.json."""
    hf = config_class(**SHAPE, **kwargs)
    raw = hf.to_dict()
    raw["architectures"] = [config_class.__name__.replace("Config", "ForCausalLM")]
    return hf, ModelConfig.from_dict(raw)


def test_every_rope_type_the_config_admits_has_its_frequencies():
    assert set(ROPE_TYPES) == set(SUPPORTED_ROPE_TYPES)


YARNS = {
    "factor only": dict(factor=4.0, original_max_position_embeddings=64),
    "mscales, betas, untruncated": dict(
        factor=8.0,
        original_max_position_embeddings=32,
        mscale=1.0,
        mscale_all_dim=0.707,
        beta_fast=16,
        beta_slow=2,
        truncate=False,
    ),
    "attention factor given": dict(
        factor=2.0, original_max_position_embeddings=128, attention_factor=0.9
    ),
}


@pytest.mark.parametrize("params", list(YARNS.values()), ids=list(YARNS))
def test_yarn(params):
    hf, ours = both(
        Qwen2Config,
        max_position_embeddings=128,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **params),
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    got = rope_frequencies(ours)
    torch.testing.assert_close(got.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert got.attention_factor == pytest.approx(factor, rel=1e-12)
    # The served context is the original one times the factor, as vLLM derives it.
    assert ours.max_position_embeddings == max(
        128, int(params["original_max_position_embeddings"] * params["factor"])
    )


def test_longrope_short_then_long_factors():
    # The tiny Phi-3's LongRoPE (8 frequencies, original context 64 of 256).
    _, phi3 = VARIANTS["phi3-longrope"]
    hf, ours = both(
        Phi3Config,
        max_position_embeddings=256,
        original_max_position_embeddings=phi3["original_max_position_embeddings"],
        rope_parameters=dict(phi3["rope_parameters"]),
    )
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=65)
    got = rope_frequencies(ours)
    assert got.inv_freq.shape == (256, 8)
    # Position p uses what transformers uses when p is the sequence's last position.
    torch.testing.assert_close(got.inv_freq[:64], short.expand(64, 8), rtol=0, atol=0)
    torch.testing.assert_close(got.inv_freq[64:], long.expand(192, 8), rtol=0, atol=0)
    assert got.attention_factor == pytest.approx(factor) and factor > 1


def test_dynamic_ntk_grows_its_base_past_the_trained_context():
    hf, ours = both(
        LlamaConfig,
        max_position_embeddings=32,
        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    )
    assert ours.max_position_embeddings == 64
    got = rope_frequencies(ours).inv_freq
    for position in (0, 31, 32, 50, 63):
        expected, factor = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=position + 1)
        torch.testing.assert_close(got[position], expected, rtol=1e-6, atol=0)
        assert factor == 1.0


def test_the_table_is_transformers_cos_and_sin():
    hf, ours = both(
        Qwen2Config,
        max_position_embeddings=64,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16
        ),
    )
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    rotary = Qwen2RotaryEmbedding(hf)
    positions = torch.arange(ours.max_position_embeddings)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    table = rope_table(ours, torch.float32, "cpu")
    half = ours.head_dim // 2
    torch.testing.assert_close(table[:, 0], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(table[:, 1, half:], sin[0, :, half:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(table[:, 1, :half], -sin[0, :, :half], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "rope, message",
    [
        (
            dict(rope_type="ntk-by-parts", factor=2.0),
            r"'ntk-by-parts'.*rope_type.*default, linear, llama3, yarn, longrope, dynamic",
        ),
        (dict(rope_type="yarn", factor=2.0), r"rope_scaling\.original_max_position_embeddings"),
        (
            dict(rope_type="longrope", original_max_position_embeddings=8),
            r"short_factor.*long_factor",
        ),
        (dict(rope_type="default", partial_rotary_factor=0.5), r"partial_rotary_factor"),
    ],
)
def test_bad_rope_settings_are_named(rope, message):
    raw = dict(
        SHAPE,
        architectures=["LlamaForCausalLM"],
        max_position_embeddings=64,
        rope_scaling=rope,
    )
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_linear():
    hf, ours = both(
        LlamaConfig,
        max_position_embeddings=64,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu")
    got = rope_frequencies(ours)
    torch.testing.assert_close(got.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert got.attention_factor == factor == 1.0
