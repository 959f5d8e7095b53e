"""Rotary position embedding as Llama and Qwen apply it (non-interleaved: dimension j rotates
with j + D/2), on q and k in place, in one launch.

The table is the model's ([max_positions, 2, D] from engine.layers.rotary.rope_table: cos, then
sin with its first half negated, both with their halves repeated), so any RoPE scaling the
model folded into its frequencies comes for free. Rotation is computed in float32 and rounded
once. This module never builds the table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    x_ptr,
    stride_t,
    stride_h,
    token,
    cos,
    sin,
    HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
):
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HALF_P)
    ok = (heads < HEADS)[:, None] & (dims < HALF)[None, :]
    first = x_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(
        first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=ok
    )


@triton.jit
def rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    table_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    table_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_Q_HEADS_P: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    NUM_K_HEADS_P: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_P)
    row = table_ptr + pos * table_stride
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    # Row 1 holds -sin in its first half and sin in its second.
    sin = tl.load(row + 3 * HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate(
        q_ptr, q_stride_t, q_stride_h, token, cos, sin, NUM_Q_HEADS, NUM_Q_HEADS_P, HALF, HALF_P
    )
    _rotate(
        k_ptr, k_stride_t, k_stride_h, token, cos, sin, NUM_K_HEADS, NUM_K_HEADS_P, HALF, HALF_P
    )


def rotary_embedding_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: torch.Tensor
) -> None:
    """q: [T, H, D], k: [T, KVH, D] (row-strided views are fine), positions: [T], table:
    [max_positions, 2, D]. Rotates q and k in place."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape[2] == head_dim and table.shape[1:] == (2, head_dim)
    assert q.stride(2) == 1 and k.stride(2) == 1 and table.is_contiguous()
    if num_tokens == 0:
        return
    half = head_dim // 2
    rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        table,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        table.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_Q_HEADS_P=triton.next_power_of_2(num_q_heads),
        NUM_K_HEADS=num_k_heads,
        NUM_K_HEADS_P=triton.next_power_of_2(num_k_heads),
        HALF=half,
        HALF_P=triton.next_power_of_2(half),
    )


def rotary_embedding_ref(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """transformers' formula from the frequencies: x * cos + rotate_half(x) * sin, in float32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return xf * emb.cos() + rotated * emb.sin()
