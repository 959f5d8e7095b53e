"""Rotary position embeddings, every rope type in this one module: the table of cos and sin per
position (built once from the config's frequencies, scaled as its rope type says), what a step
gathers from it once for every layer, and the rotation of q and k (the backend's op).

A rope type is a function in `_ROPE_TYPES` giving the inverse frequencies and the attention
factor (cos and sin are scaled by it) as transformers' rope init functions compute them for the
same config: adding one is adding a function there, and its name to
engine.models.config.SUPPORTED_ROPE_TYPES (the config stays torch-free; a test checks the two
agree). Where transformers recomputes the frequencies from the length of the sequence in its
forward (`longrope`, `dynamic`), a paged engine cannot: a position's keys are cached once. So
the table holds, for each position p, the frequencies transformers uses when p is the last
position of the sequence: longrope's short factors below original_max_position_embeddings and
its long ones from there on; dynamic NTK's base grown for a sequence of p + 1 tokens past
max_position_embeddings. Non-interleaved RoPE only (dimension j rotates with j + D/2), as the
Llama family applies it. This module never touches q or k but through the backend's rotary_.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.config import ModelConfig


def _exponents(dim: int) -> torch.Tensor:
    """2i / D for i < D / 2, in float32 as transformers computes them."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _plain(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim))


@dataclass
class RopeFrequencies:
    # [D / 2] for every position alike, or [max_positions, D / 2] one row per position.
    inv_freq: torch.Tensor
    # cos and sin are multiplied by it (YaRN's and LongRoPE's attention scaling).
    attention_factor: float = 1.0


def _default(config: ModelConfig, params: dict) -> RopeFrequencies:
    return RopeFrequencies(_plain(config.rope_theta, config.head_dim))


def _linear(config: ModelConfig, params: dict) -> RopeFrequencies:
    return RopeFrequencies(_plain(config.rope_theta, config.head_dim) / params["factor"])


def _llama3(config: ModelConfig, params: dict) -> RopeFrequencies:
    inv_freq = _plain(config.rope_theta, config.head_dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params.get("original_max_position_embeddings", config.max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return RopeFrequencies(torch.where(medium, smoothed, scaled))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config: ModelConfig, params: dict) -> RopeFrequencies:
    dim, base = config.head_dim, config.rope_theta
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength turns `rotations` times over the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # High-frequency dimensions extrapolate (kept), low-frequency ones interpolate (/ factor).
    extrapolated = 1 - ramp
    pos_freqs = base ** _exponents(dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return RopeFrequencies(inv_freq, float(attention_factor))


def _longrope(config: ModelConfig, params: dict) -> RopeFrequencies:
    dim = config.head_dim
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    shape = config.rope_theta ** _exponents(dim)
    short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * shape)
    long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * shape)
    rows = torch.arange(config.max_position_embeddings)[:, None]
    return RopeFrequencies(torch.where(rows < original, short, long), float(attention_factor))


def _dynamic(config: ModelConfig, params: dict) -> RopeFrequencies:
    dim, factor = config.head_dim, params["factor"]
    original = params["original_max_position_embeddings"]
    # transformers' dynamic NTK base for a sequence whose last position is p (its base as it
    # is up to `original` tokens), computed in float64 as its Python floats are.
    lengths = torch.arange(1, config.max_position_embeddings + 1, dtype=torch.float64)
    grown = (factor * lengths.clamp(min=original) / original - (factor - 1)) ** (dim / (dim - 2))
    bases = (config.rope_theta * grown).float()
    return RopeFrequencies(1.0 / (bases[:, None] ** _exponents(dim)))


# Rope type -> (the model config, its rope parameters) -> frequencies.
_ROPE_TYPES: dict[str, Callable[[ModelConfig, dict], RopeFrequencies]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    "dynamic": _dynamic,
}
ROPE_TYPES = tuple(_ROPE_TYPES)


def rope_frequencies(config: ModelConfig) -> RopeFrequencies:
    """The config's inverse frequencies and attention factor, scaled as its rope type says."""
    params = config.rope_scaling or {"rope_type": "default"}
    return _ROPE_TYPES[params["rope_type"]](config, params)


def rope_table(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[max_positions, 2, head_dim]: cos, and sin with its first half negated.

    With the halves of x swapped, x * cos + swapped * signed_sin is transformers'
    x * cos + rotate_half(x) * sin (non-interleaved RoPE), in three ops instead of six.
    """
    dim = config.head_dim
    frequencies = rope_frequencies(config)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = positions[:, None] * frequencies.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if frequencies.attention_factor != 1.0:
        cos, sin = cos * frequencies.attention_factor, sin * frequencies.attention_factor
    sin[:, : dim // 2].neg_()
    return torch.stack((cos, sin), dim=1).to(dtype=dtype, device=device)


@dataclass
class RopeInputs:
    """What every layer's rotary embedding reads, gathered once per step."""

    backend: AttentionBackend
    positions: torch.Tensor
    table: torch.Tensor
    cos_sin: tuple[torch.Tensor, torch.Tensor]

    def rotate_(self, qk: torch.Tensor, num_q_heads: int) -> None:
        """Rotates q = qk[:, :num_q_heads] and k = qk[:, num_q_heads:] ([T, heads, D]) in place."""
        self.backend.rotary_(qk, num_q_heads, self.positions, self.table, self.cos_sin)


class RotaryEmbedding(nn.Module):
    """A model's rope table (a buffer, not a checkpoint weight) and, per step, its RopeInputs."""

    table: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.register_buffer("table", rope_table(config, dtype, device), persistent=False)

    def step_inputs(self, positions: torch.Tensor) -> RopeInputs:
        rows = self.table[positions]
        return RopeInputs(self.backend, positions, self.table, (rows[:, 0:1], rows[:, 1:2]))
