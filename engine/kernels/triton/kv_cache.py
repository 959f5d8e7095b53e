"""Writes a step's new K and V into the paged KV cache at their slots.

Token t's K and V (every KV head) go to flat slot slot_mapping[t] = block * block_size + offset
of the cache [2, num_blocks, block_size, KVH, D]; a negative slot marks a padding token (a
CUDA-graph batch padded to its captured size) and writes nothing. Values are copied bit for
bit: no conversion, so bfloat16 passes through the interpreter untouched. This module never
reads the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_mapping_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    v_offset,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    i = tl.arange(0, BLOCK)
    ok = i < NUM_KV_HEADS * HEAD_DIM
    head = i // HEAD_DIM
    dim = i % HEAD_DIM
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dim, mask=ok)
    v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dim, mask=ok)
    dst = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + i
    tl.store(dst, k, mask=ok)
    tl.store(dst + v_offset, v, mask=ok)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, KVH, D] (row-strided views are fine); slot_mapping: [T] int64."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert (
        kv_cache.is_contiguous() and kv_cache.shape[3:] == k.shape[1:] and kv_cache.dtype == k.dtype
    )
    assert k.stride(2) == 1 and v.stride(2) == 1 and v.shape == k.shape
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
    )


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = kv_cache.view(2, -1, *k.shape[1:])
    slots[0][slot_mapping[keep]] = k[keep]
    slots[1][slot_mapping[keep]] = v[keep]
