"""RMSNorm as a layer: its weight and epsilon; the attention backend computes it, fused with
the residual add where the backend has a kernel for that (Triton). This module never computes
a norm itself, so a norm's numerics live in one place per backend (engine.attention).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.layers.linear import empty_parameter


class RMSNorm(nn.Module):
    def __init__(
        self,
        size: int,
        eps: float,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = empty_parameter(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x, or with a residual: residual += x in place, then RMSNorm of the sum."""
        return self.backend.rms_norm(x, self.weight, self.eps, residual)
