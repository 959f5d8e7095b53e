"""`python -m bench.gpu_kernels`: paged decode attention (Triton) against two torch baselines
on a CUDA GPU, in bfloat16: gathering the blocks then scaled_dot_product_attention, and dense
SDPA (flash) over contiguous K/V of the same lengths, which is the floor paging should approach.

Prints microseconds per call and the speedups. A benchmark: it checks the outputs agree and
asserts nothing else; it never runs in the test suite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.kernels.triton.paged_attention import paged_decode_attention

BLOCK_SIZE = 16
# (label, query heads, KV heads, head size)
MODELS = [("smollm2-135m", 9, 3, 64), ("llama-8b", 32, 8, 128)]
CASES = [(1, 512), (1, 4096), (32, 1024), (128, 512), (64, 2048)]  # (batch, context)


def bench_case(
    num_heads: int, num_kv_heads: int, head_dim: int, batch: int, context: int
) -> dict[str, float]:
    dtype, device = torch.bfloat16, "cuda"
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    # Scattered tables: a random permutation of the pool.
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5

    def triton_paged():
        return paged_decode_attention(q, cache, block_tables, seq_lens, scale)

    def torch_gather():
        kv = (
            cache[:, block_tables.long()]
            .view(2, batch, context, num_kv_heads, head_dim)
            .transpose(2, 3)
        )
        out = F.scaled_dot_product_attention(
            q[:, :, None], kv[0], kv[1], scale=scale, enable_gqa=True
        )
        return out[:, :, 0]

    group = num_heads // num_kv_heads
    kv_dense = (
        cache[:, block_tables.long()]
        .view(2, batch, context, num_kv_heads, head_dim)
        .transpose(2, 3)
    )
    k_dense = kv_dense[0].repeat_interleave(group, dim=1).contiguous()
    v_dense = kv_dense[1].repeat_interleave(group, dim=1).contiguous()

    def dense_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, scale=scale)[
                :, :, 0
            ]

    expected = torch_gather().float()
    for fn in (triton_paged, dense_flash):
        err = (fn().float() - expected).abs().max().item()
        if err > 3e-2:
            print(f"  WARNING {fn.__name__} differs from the gather baseline by {err:.3g}")
    return {
        fn.__name__: 1000 * triton.testing.do_bench(fn, warmup=10, rep=50)
        for fn in (triton_paged, torch_gather, dense_flash)
    }


def main() -> None:
    print(
        f"GPU {torch.cuda.get_device_name()}  bf16  block size {BLOCK_SIZE}  "
        "(microseconds per call)"
    )
    print(
        f"{'model':14s} {'batch':>5s} {'ctx':>5s} {'triton':>9s} {'gather+sdpa':>12s} "
        f"{'dense flash':>12s} {'vs gather':>9s} {'vs dense':>9s}"
    )
    for label, heads, kv_heads, head_dim in MODELS:
        for batch, context in CASES:
            t = bench_case(heads, kv_heads, head_dim, batch, context)
            print(
                f"{label:14s} {batch:5d} {context:5d} {t['triton_paged']:9.1f} "
                f"{t['torch_gather']:12.1f} "
                f"{t['dense_flash']:12.1f} {t['torch_gather'] / t['triton_paged']:8.2f}x "
                f"{t['dense_flash'] / t['triton_paged']:8.2f}x"
            )


if __name__ == "__main__":
    main()
