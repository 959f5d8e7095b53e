"""Test helper for the kernel tests: the device they run on, dtypes and tolerances.

Outputs are compared with float32 references computed from the same (already rounded) inputs,
so the tolerance is about one rounding of the output to its dtype plus float32 accumulation.
"""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("FOLIO_KERNEL_DEVICE", "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    # On a GPU, attention's P @ V runs on tf32 tensor cores for 16-bit inputs, which truncate
    # P to 10 bits; float32 inputs use ieee and keep the tight bound.
    torch.float16: dict(atol=1e-2, rtol=1e-2) if DEVICE == "cuda" else dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCE[dtype])


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(dtype=dtype, device=DEVICE)
