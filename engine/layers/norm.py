"""RMSNorm as a layer: its weight and epsilon (and Gemma's variant, scaling by 1 + weight); the
attention backend computes it, fused with the residual add where the backend has a kernel for
that (Triton). This module never computes
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


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint holds w, the norm scales by 1 + w (set by
    finalize_weights, once the loader has filled w)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale: torch.Tensor | None = None

    def finalize_weights(self) -> None:
        self.scale = self.weight + 1

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        assert self.scale is not None, "finalize_weights() was not called"
        return self.backend.rms_norm(x, self.scale, self.eps, residual)
