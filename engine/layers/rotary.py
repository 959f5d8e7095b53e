"""Rotary position embeddings, every rope type in this one module: the table of cos and sin per
position (built once from the config's frequencies, scaled as its rope type says), what a step
gathers from it once for every layer, and the rotation of q and k (the backend's op).

A rope type is a function scaling the inverse frequencies (`_FREQUENCY_SCALINGS`): adding one
is adding a function there, and its name to engine.models.config.SUPPORTED_ROPE_TYPES (the
config stays torch-free; a test checks the two agree). Non-interleaved RoPE only (dimension j
rotates with j + D/2), as the Llama family applies it. This module never touches q or k but
through the backend's rotary_.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.config import ModelConfig


def _llama3_frequencies(inv_freq: torch.Tensor, params: dict, max_positions: int) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


# Rope type -> (inverse frequencies, the config's rope parameters, max positions) -> scaled
# inverse frequencies. "default" scales nothing.
_FREQUENCY_SCALINGS: dict[str, Callable[[torch.Tensor, dict, int], torch.Tensor]] = {
    "llama3": _llama3_frequencies,
}
ROPE_TYPES = ("default", *_FREQUENCY_SCALINGS)


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32: theta^(-2i/D), scaled as the config's rope type says."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    params = config.rope_scaling
    if params is None:
        return inv_freq
    scaling = _FREQUENCY_SCALINGS[params["rope_type"]]
    return scaling(inv_freq, params, config.max_position_embeddings)


def rope_table(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[max_positions, 2, head_dim]: cos, and sin with its first half negated.

    With the halves of x swapped, x * cos + swapped * signed_sin is transformers'
    x * cos + rotate_half(x) * sin (non-interleaved RoPE), in three ops instead of six.
    """
    dim = config.head_dim
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(positions, inverse_frequencies(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, : dim // 2].neg_()
    return torch.stack((emb.cos(), sin), dim=1).to(dtype=dtype, device=device)


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
