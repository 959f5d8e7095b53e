"""RMSNorm, optionally fused with the residual add before it.

With a residual: residual += x (rounded to its dtype, written back in place), and the
normalised sum is returned; without: the normalised x. Numerics follow transformers (and
engine.attention.backend.torch_rms_norm): normalise in float32, round to the input dtype, then
scale by the weight with one rounding, which is exactly a multiply in the model dtype. This
module never changes x or the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    eps,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < SIZE
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        total = x + tl.load(residual_ptr + row * residual_stride + cols, mask=ok, other=0.0).to(
            tl.float32
        )
        total = total.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * residual_stride + cols, total, mask=ok)
        x = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / SIZE + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * out_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=ok
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, size] (row-strided is fine), weight: [size], residual: [T, size] or None."""
    size = x.shape[-1]
    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (size,)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
    if x.shape[0] == 0:
        return out
    rms_norm_kernel[(x.shape[0],)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        eps,
        SIZE=size,
        BLOCK=triton.next_power_of_2(size),
        HAS_RESIDUAL=residual is not None,
    )
    return out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed
