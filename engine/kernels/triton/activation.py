"""SiLU-and-multiply for the gated MLP: out = silu(gate) * up, with gate and up the two halves
of the fused gate_up projection [T, 2I]. Like the torch model, silu is rounded to the model
dtype before the multiply. This module never changes its input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def silu_and_mul_kernel(
    x_ptr, out_ptr, x_stride, out_stride, SIZE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < SIZE
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + SIZE + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x: [T, 2I] -> [T, I]."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    size = x.shape[1] // 2
    out = torch.empty((x.shape[0], size), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = min(block, triton.next_power_of_2(size))
    silu_and_mul_kernel[(x.shape[0], triton.cdiv(size, block))](
        x, out, x.stride(0), out.stride(0), SIZE=size, BLOCK=block
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
