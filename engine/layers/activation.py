"""The gated MLP's activation as a layer: SiLU of the gate times the up projection, over the
two halves of a fused gate_up product; the attention backend computes it (one kernel on GPU).
Only SiLU exists because it is the only activation the model configs admit
(engine.models.config). This module never computes the activation itself.
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
