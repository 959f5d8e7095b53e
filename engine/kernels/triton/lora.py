"""Segmented LoRA: every adapter of a step's batch in two launches (shrink, then expand).

A step's rows are sorted by LoRA slot (engine.layers.lora: `sorted_rows`, and per segment its
start in that order, its length and its slot; rows of the base model are in no segment). One
program multiplies a block of BLOCK_M rows of one segment by a tile of its slot's weight:
shrink stores x[rows] @ A[slot].T into the narrow intermediate, expand adds y[rows] @
B[slot].T into the base layer's output, in place (each row belongs to one segment: no two
programs write the same element). The grid is sized from the row count, not the longest
segment, so no host synchronisation is needed; blocks past a segment's end exit at once.
`lora_ref` is the plain loop over segments the kernels must equal. This module never changes
its inputs (but the output expand adds into).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def lora_segment_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    segments_ptr,
    n,
    k,
    x_stride,
    w_stride_s,
    w_stride_n,
    out_stride,
    ADD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[r] (+)= x[r] @ w[slot].T for the rows r of block program_id(1) of segment
    program_id(0), columns of tile program_id(2)."""
    segment = tl.program_id(0)
    start = tl.load(segments_ptr + segment * 3)
    length = tl.load(segments_ptr + segment * 3 + 1)
    slot = tl.load(segments_ptr + segment * 3 + 2).to(tl.int64)
    first = tl.program_id(1) * BLOCK_M
    if first >= length:
        return
    offsets = first + tl.arange(0, BLOCK_M)
    row_ok = offsets < length
    rows = tl.load(rows_ptr + start + offsets, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + slot * w_stride_s + cols[None, :].to(tl.int64) * w_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x = tl.load(
            x_ptr + rows[:, None] * x_stride + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w.to(tl.float32), acc, input_precision=DOT_PRECISION)
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ADD:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
    add: bool,
) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (segments.shape[0], triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, block_n))
    lora_segment_kernel[grid](
        x,
        w,
        out,
        rows,
        segments,
        n,
        k,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        ADD=add,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # As the fused MoE's: 16-bit values are exact in tf32, float32 gets ieee.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, segments: torch.Tensor
) -> torch.Tensor:
    """x [T, in], a [slots, width, in], rows [R] int32 (sorted by slot), segments [S, 3] int32
    (start in rows, length, slot) -> [T, width] in x's dtype: x[r] @ a[slot].T on the
    segments' rows, zero elsewhere."""
    assert x.stride(1) == 1 and a.is_contiguous()
    y = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, a, y, rows, segments, add=False)
    return y


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out[r] += y[r] @ b[slot].T on the segments' rows (b [slots, out, width])."""
    assert y.stride(1) == 1 and b.is_contiguous() and out.stride(1) == 1
    _launch(y, b, out, rows, segments, add=True)


def lora_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """The plain loop over segments: out plus, on each segment's rows, (x @ A.T, rounded to x's
    dtype as the kernel stores it) @ B.T, in float32, rounded to out's dtype."""
    result = out.float().clone()
    for start, length, slot in segments.tolist():
        r = rows[start : start + length].long()
        y = (x[r].float() @ a[slot].float().T).to(x.dtype)
        result[r] += y.float() @ b[slot].float().T
    return result.to(out.dtype)
