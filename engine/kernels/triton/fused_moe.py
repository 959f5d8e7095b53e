"""Fused mixture of experts: every expert of a layer in two grouped GEMM launches.

The step's (token, expert) pairs are sorted by expert into blocks of BLOCK_M pairs, each
expert's pairs padded to whole blocks (`align_pairs`, plain torch on the device: no host
synchronisation, so CUDA graphs can capture it; the grid is sized for the worst case and
blocks past the end exit at once). One program computes a block of pairs times a tile of one
expert's weight: gate_up for every pair, SiLU-and-mul (engine.kernels.triton.activation, or
the activation given: gpt-oss's clamped SwiGLU), then down, scaled by the pair's routing
weight; each token's k rows are summed at the end. Each GEMM may add its expert's bias row
(gpt-oss's) before the routing weight scales it. A pair
whose expert id is -1 (another rank's expert, with expert parallelism) is never computed and
adds nothing. `fused_moe_ref` is the plain loop over experts the kernel must equal. This module
never changes its inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.triton.activation import silu_and_mul

BLOCK_M = 16


@triton.jit
def fused_moe_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    bias_ptr,  # [E, n] each expert's bias (read only with HAS_BIAS)
    weights_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    n,
    k,
    a_stride,
    w_stride_e,
    w_stride_n,
    c_stride,
    TOP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[pair] = a[pair // TOP_K] @ w[expert].T (+ bias[expert] if HAS_BIAS; times the pair's
    weight if MUL_WEIGHT), for the BLOCK_M pairs of block program_id(0) and the BLOCK_N columns
    of program_id(1)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # past the last block, or a padding block
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    rows = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(
            a_ptr + rows[:, None] * a_stride + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * n + cols, mask=col_ok, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out = c_ptr + pairs[:, None].to(tl.int64) * c_stride + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def align_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] (expert per pair, -1 for none) -> (sorted_pairs, block_expert).

    sorted_pairs [P + E * (block_m - 1)] int32: pair numbers (token * k + j) grouped by expert,
    each expert's group padded with P (no pair) to whole blocks; block_expert [blocks] int32:
    each block's expert, -1 past the last one."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    device = flat.device
    # Pairs with no expert sort last, into a group of their own that no block reads.
    keys = torch.where(flat < 0, num_experts, flat)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    group_start = torch.cumsum(padded, 0) - padded
    first_pair = torch.cumsum(counts, 0) - counts
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    capacity = num_pairs + num_experts * (block_m - 1)
    slot = group_start[sorted_keys] + torch.arange(num_pairs, device=device)
    slot -= first_pair[sorted_keys]
    slot = torch.where(sorted_keys == num_experts, capacity, slot)  # the sink slot, dropped
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    num_blocks = triton.cdiv(capacity, block_m)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_end = torch.cumsum(padded[:num_experts], 0)
    block_expert = torch.searchsorted(block_end, block_start, right=True).to(torch.int32)
    block_expert = torch.where(block_expert >= num_experts, -1, block_expert)
    return sorted_pairs[:capacity], block_expert


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    mul_weight: bool,
    bias: torch.Tensor | None,
) -> None:
    num_pairs = out.shape[0]
    n, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    fused_moe_kernel[grid](
        a,
        w,
        out,
        w if bias is None else bias,
        weights,
        sorted_pairs,
        block_expert,
        num_pairs,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TOP_K=top_k,
        MUL_WEIGHT=mul_weight,
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # 16-bit values are exact in tf32: tensor cores lose nothing on them (and the
        # interpreter cannot multiply bfloat16); float32 models get ieee.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], weights [T, k] float32,
    ids [T, k] (an expert of w13/w2, or -1 for none), optional biases b13 [E, 2I] and b2 [E, H],
    `act` [P, 2I] -> [P, I] -> sum over j of weights[t, j] * expert_{ids[t, j]}(x[t]), [T, H]
    in x's dtype."""
    assert x.dim() == 2 and x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    assert b13 is None or b13.is_contiguous()
    assert b2 is None or b2.is_contiguous()
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    out = torch.zeros(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out.view(num_tokens, top_k, -1).sum(dim=1)
    sorted_pairs, block_expert = align_pairs(ids, w13.shape[0])
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    flat_weights = weights.flatten().float().contiguous()
    _grouped_gemm(x, w13, gate_up, flat_weights, sorted_pairs, block_expert, top_k, False, b13)
    hidden = act(gate_up)
    _grouped_gemm(hidden, w2, out, flat_weights, sorted_pairs, block_expert, 1, True, b2)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The plain loop over experts, each one over the tokens routed to it: products in float32,
    rounded to x's dtype where the kernel stores them (gate_up, the activation, each pair's
    weighted output); `act` as fused_moe's, None for SiLU-and-mul rounded as its kernel
    rounds."""
    dtype = x.dtype
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, slot = torch.where(ids == expert)
        if tokens.numel() == 0:
            continue
        gate_up = F.linear(
            x[tokens].float(), w13[expert].float(), None if b13 is None else b13[expert].float()
        ).to(dtype)
        if act is None:
            gate, up = gate_up.float().chunk(2, dim=-1)
            hidden = (F.silu(gate).to(dtype).float() * up).to(dtype)  # as silu_and_mul rounds
        else:
            hidden = act(gate_up)
        down = F.linear(
            hidden.float(), w2[expert].float(), None if b2 is None else b2[expert].float()
        )
        h = down * weights[tokens, slot, None].float()
        out.index_add_(0, tokens, h.to(dtype).float())
    return out.to(dtype)
