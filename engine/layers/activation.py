"""The gated MLP's activation as a layer: SiLU (or Gemma's tanh-approximated GeLU) of the gate
times the up projection, over the two halves of a fused gate_up product (or gpt-oss's clamped
SwiGLU of its experts); the attention backend
computes it (SiLU in one kernel on GPU). `gated_activation` maps the configs' hidden_act names
(engine.models.config.SUPPORTED_ACTIVATIONS) onto them. This module never computes the
activation itself.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend


class SiluAndMul(nn.Module):
    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(gate) * up, [T, I]."""
        return self.backend.silu_and_mul(gate_up)


class GeluTanhAndMul(nn.Module):
    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> gelu_tanh(gate) * up, [T, I]."""
        return self.backend.gelu_tanh_and_mul(gate_up)


class ClampedSwiGLU(nn.Module):
    """gpt-oss's experts: the gate clamped above at `limit`, up within +-limit, then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, backend: AttentionBackend, alpha: float, limit: float) -> None:
        super().__init__()
        self.backend = backend
        self.alpha = alpha
        self.limit = limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, then up) -> [T, I]."""
        return self.backend.clamped_swiglu(gate_up, self.alpha, self.limit)


_GATED = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def gated_activation(hidden_act: str, backend: AttentionBackend) -> nn.Module:
    """The layer for a config's hidden_act (checked by the config already)."""
    return _GATED[hidden_act](backend)
