"""KV cache write, RMSNorm (+ residual), rotary embedding and SiLU-and-mul against their
pure-torch references, on strided views as the model produces them."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn

from engine.kernels.triton.activation import silu_and_mul, silu_and_mul_ref
from engine.kernels.triton.kv_cache import write_kv_cache, write_kv_cache_ref
from engine.kernels.triton.rms_norm import rms_norm, rms_norm_ref
from engine.kernels.triton.rotary import rotary_embedding_, rotary_embedding_ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_copies_to_scattered_slots_and_skips_padding(dtype):
    num_tokens, num_kv_heads, head_dim = 6, 3, 64
    kv = randn(num_tokens, 2 * num_kv_heads + 1, head_dim, dtype=dtype, seed=1)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1 :]
    slots = torch.tensor([37, 2, -1, 16, 15, 63], dtype=torch.int64, device=DEVICE)
    cache = randn(2, 8, 8, num_kv_heads, head_dim, dtype=dtype, seed=2)
    expected = cache.clone()
    write_kv_cache(k, v, cache, slots)
    write_kv_cache_ref(k, v, expected, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    size = 72  # not a power of two: masked columns
    x = randn(5, 2 * size, dtype=dtype, seed=3)[:, :size]  # row-strided
    weight = randn(size, dtype=dtype, seed=4, scale=0.5) + 1
    residual = randn(5, size, dtype=dtype, seed=5) if with_residual else None
    expected_residual = None if residual is None else residual.clone()
    out = rms_norm(x, weight, 1e-5, residual)
    expected = rms_norm_ref(x, weight, 1e-5, expected_residual)
    assert_close(out, expected, dtype)
    if with_residual:
        assert_close(residual, expected_residual, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_transformers_formula(dtype, head_dim):
    num_tokens, num_heads, num_kv_heads = 5, 9, 3
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    # The model's table layout: cos, then sin with its first half negated, halves repeated.
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    signed_sin = emb.sin()
    signed_sin[:, : head_dim // 2].neg_()
    table = torch.stack((emb.cos(), signed_sin), dim=1).to(DEVICE)
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, seed=6)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    q0, k0, untouched = q.clone(), k.clone(), qkv[:, num_heads + num_kv_heads :].clone()
    positions = torch.tensor([0, 3, 63, 17, 18], device=DEVICE)
    rotary_embedding_(q, k, positions, table)
    assert_close(q, rotary_embedding_ref(q0.cpu(), positions.cpu(), inv_freq), dtype)
    assert_close(k, rotary_embedding_ref(k0.cpu(), positions.cpu(), inv_freq), dtype)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], untouched)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_reference(dtype):
    x = randn(4, 2 * 96, dtype=dtype, seed=7, scale=3.0)
    # block 64 over 96 columns: two column tiles, the second half masked.
    assert_close(silu_and_mul(x, block=64), silu_and_mul_ref(x), dtype)
