"""Paged attention kernels (decode and prefill/extend) against a float32 loop reference, and
the Triton backend against the torch backend on one mixed step."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn

from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.kernels.triton.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from paged import BlockPool, build_metadata, outside_window

# (query heads, KV heads, head size, block size): GQA 1, 3 (SmolLM2: 9 over 3), 4.
SHAPES = [(2, 2, 64, 16), (9, 3, 64, 4), (8, 2, 128, 8)]
NUM_BLOCKS = 40


def make_cache(
    num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    return randn(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim, dtype=dtype, seed=seed)


def tables(seq_lens: list[int], block_size: int, seed: int) -> list[list[int]]:
    pool = BlockPool(NUM_BLOCKS, seed)
    return [pool.grow([], s, block_size) for s in seq_lens]


def as_tensor(table_list: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in table_list)
    return torch.tensor(
        [t + [0] * (width - len(t)) for t in table_list], dtype=torch.int32, device=DEVICE
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_matches_reference(shape, dtype):
    num_heads, num_kv_heads, head_dim, block_size = shape
    # Context 1, lengths off the block size, and one spanning two 16-position tiles.
    seq_lens = [1, 7, 20, 33]
    table_list = tables(seq_lens, block_size, seed=1)
    cache = make_cache(num_kv_heads, head_dim, block_size, dtype, seed=2)
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, seed=3)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q,
        cache,
        as_tensor(table_list),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        scale,
        block_n=16,
    )
    assert_close(out, paged_decode_attention_ref(q, cache, seq_lens, table_list, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prefill_matches_reference(shape, dtype):
    num_heads, num_kv_heads, head_dim, block_size = shape
    # A fresh prompt, a cached prefix longer than its 3 new tokens, a one-token context, and
    # 19 tokens over several query tiles; the first row belongs to no request and stays as is.
    query_lens = [5, 3, 1, 19]
    seq_lens = [5, 22, 1, 19]
    table_list = tables(seq_lens, block_size, seed=4)
    cache = make_cache(num_kv_heads, head_dim, block_size, dtype, seed=5)
    q = randn(1 + sum(query_lens), num_heads, head_dim, dtype=dtype, seed=6)
    starts = torch.tensor([1, 6, 9, 10, 29], dtype=torch.int32, device=DEVICE)
    out = torch.zeros_like(q)
    scale = head_dim**-0.5
    paged_prefill_attention(
        q,
        cache,
        starts,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        as_tensor(table_list),
        scale,
        max(query_lens),
        out=out,
        block_n=16,
        rows_per_tile=16,
    )
    expected = paged_prefill_attention_ref(q[1:], cache, query_lens, seq_lens, table_list, scale)
    assert_close(out[1:], expected, dtype)
    assert not out[0].any()


def mixed_step(
    shape: tuple[int, int, int, int],
    query_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype,
    seed: int,
):
    """A step's block tables, metadata, cache, and q, k and v as strided views of one fused
    projection, as the model passes them."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    table_list = tables(seq_lens, block_size, seed=seed)
    meta = build_metadata(query_lens, seq_lens, table_list, block_size)
    cache = make_cache(num_kv_heads, head_dim, block_size, dtype, seed=seed + 1)
    qkv = randn(sum(query_lens), num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, seed=seed + 2)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:-num_kv_heads], qkv[:, -num_kv_heads:]
    return table_list, meta, cache, q, k, v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_backend_matches_torch_backend_on_a_mixed_step(dtype):
    # Two decodes, an extend over a cached prefix and a fresh prefill.
    _, meta, cache, q, k, v = mixed_step((9, 3, 64, 8), [1, 1, 4, 6], [12, 1, 21, 6], dtype, 7)

    expected_cache = cache.cpu().clone()
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    expected = backend.forward(q.cpu(), k.cpu(), v.cpu(), expected_cache, meta, 0.125)

    triton_backend = TritonAttentionBackend(DEVICE)
    triton_backend.prepare(meta)
    out = triton_backend.forward(q, k, v, cache, meta, 0.125)
    assert torch.equal(cache.cpu(), expected_cache)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sliding_window_reads_only_the_window(dtype):
    """Decodes and prefills under a window of 5 with blocks of 4: every block wholly before a
    request's window is a NaN-filled block in its table, which no kernel may read."""
    num_heads, num_kv_heads, head_dim, block_size, window = 4, 2, 16, 4, 5
    poison = NUM_BLOCKS - 1
    cache = make_cache(num_kv_heads, head_dim, block_size, dtype, seed=10)
    cache[:, poison] = float("nan")
    scale = head_dim**-0.5
    seq_lens = [3, 9, 30]
    full = [
        BlockPool(NUM_BLOCKS - 1, seed=s).grow([], n, block_size) for s, n in enumerate(seq_lens)
    ]
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, seed=11)
    seen = outside_window(full, [1] * 3, seq_lens, window, block_size, poison)
    out = paged_decode_attention(
        q,
        cache,
        as_tensor(seen),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        scale,
        block_n=16,
        window=window,
    )
    expected = paged_decode_attention_ref(q, cache, seq_lens, full, scale, window)
    assert_close(out, expected, dtype)

    # A fresh prompt longer than the window, and an extend over a cached prefix.
    query_lens, seq_lens = [13, 6], [13, 26]
    full = [
        BlockPool(NUM_BLOCKS - 1, seed=s).grow([], n, block_size) for s, n in enumerate(seq_lens)
    ]
    seen = outside_window(full, query_lens, seq_lens, window, block_size, poison)
    q = randn(sum(query_lens), num_heads, head_dim, dtype=dtype, seed=12)
    out = paged_prefill_attention(
        q,
        cache,
        torch.tensor([0, 13, 19], dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        as_tensor(seen),
        scale,
        max(query_lens),
        block_n=16,
        rows_per_tile=16,
        window=window,
    )
    expected = paged_prefill_attention_ref(q, cache, query_lens, seq_lens, full, scale, window)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_sinks_in_both_backends(dtype, window):
    """gpt-oss's sinks (one more logit per head, of no value) on a mixed step: two decodes, an
    extend over a cached prefix and a fresh prefill, in the torch backend (Folio's C++ kernel
    where it loads) and the Triton one, against the float32 reference."""
    num_heads, head_dim = 8, 16
    query_lens, seq_lens = [1, 1, 4, 7], [12, 3, 21, 7]
    table_list, meta, cache, q, k, v = mixed_step(
        (num_heads, 2, head_dim, 4), query_lens, seq_lens, dtype, 13
    )
    # Sinks as large as the scores, so that they move every row's weights.
    sinks = randn(num_heads, dtype=dtype, seed=16, scale=2.0)
    scale = head_dim**-0.5

    torch_cache = cache.cpu().clone()
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    got_torch = backend.forward(
        q.cpu(), k.cpu(), v.cpu(), torch_cache, meta, scale, window, sinks.cpu()
    )
    expected = paged_prefill_attention_ref(
        q, torch_cache, query_lens, seq_lens, table_list, scale, window, sinks
    )
    assert_close(got_torch, expected, dtype)
    without = paged_prefill_attention_ref(
        q, torch_cache, query_lens, seq_lens, table_list, scale, window
    )
    assert not torch.allclose(expected, without, atol=1e-2)  # the sinks matter here

    triton_backend = TritonAttentionBackend(DEVICE)
    triton_backend.prepare(meta)
    got_triton = triton_backend.forward(q, k, v, cache, meta, scale, window, sinks)
    assert torch.equal(cache.cpu(), torch_cache)
    assert_close(got_triton, expected, dtype)
