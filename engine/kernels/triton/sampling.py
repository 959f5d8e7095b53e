"""Token selection on the GPU, one program per row, with per-row parameters and no sort.

Greedy rows (temperature 0) take the exact argmax, ties to the lowest id. Other rows divide by
their temperature, then keep (as engine.sampler documents) the top-k logits (ties at the edge
stay), the top-p nucleus of what remains (plus ties of its least likely token), and the tokens
at least min_p times as likely as the top one; the token is argmax(probs / q), q = -log(U), the
exponential race (Gumbel-max). U comes from Philox keyed by the row's seed and the token id, so
a row's draw depends on nothing else in the batch: the caller passes a fresh seed per row and
step (derived from the request's seed and its step for seeded requests).

The k-th largest logit and the nucleus edge are found by bisection over the float32 bit
patterns (mapped to integers in the same order), 32 passes over the row each: exact, with no
sort and no scratch memory. This module never changes the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    """int64 with the order of the float32 x (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _uniform(seed, cols):
    return tl.rand(seed, cols)


@triton.jit
def _count_at_least(base, vocab, temperature, key, BLOCK_V: tl.constexpr):
    count = 0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) / temperature
        count += tl.sum((_order_key(x) >= key).to(tl.int32), 0)
    return count


@triton.jit
def _mass_at_least(base, vocab, temperature, key, floor_key, top, BLOCK_V: tl.constexpr):
    """Sum of exp(l - top) over the logits whose key is >= key and >= floor_key."""
    mass = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) / temperature
        k = _order_key(x)
        mass += tl.sum(tl.where((k >= key) & (k >= floor_key), tl.exp(x - top), 0.0), 0)
    return mass


@triton.jit
def sample_kernel(
    logits_ptr,
    out_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seeds_ptr,
    logits_stride,
    vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_stride
    lanes = tl.arange(0, BLOCK_V)

    # Pass 1: per-lane running max and its first column, then the lowest column of the max.
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_col = lanes
    for start in range(0, vocab, BLOCK_V):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
        better = x > best
        best = tl.where(better, x, best)
        best_col = tl.where(better, cols, best_col)
    top_raw = tl.max(best, 0)
    argmax = tl.min(tl.where(best == top_raw, best_col, 2147483647), 0)

    temperature = tl.load(temperature_ptr + row)
    if temperature == 0.0:
        tl.store(out_ptr + row, argmax.to(tl.int64))
        return

    top = top_raw / temperature  # division by a positive number keeps the order
    top_key = _order_key(top)
    lowest = tl.cast(-2147483648, tl.int64)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)

    # Largest key t with at least top_k logits >= t: the k-th largest logit.
    k_key = lowest
    if (top_k > 0) & (top_k < vocab):
        hi = top_key
        for _ in range(32):
            mid = (k_key + hi + 1) >> 1
            if _count_at_least(base, vocab, temperature, mid, BLOCK_V) >= top_k:
                k_key = mid
            else:
                hi = mid - 1

    # Largest key t whose logits (among the top-k) hold at least top_p of the top-k mass.
    p_key = lowest
    if top_p < 1.0:
        target = top_p * _mass_at_least(base, vocab, temperature, lowest, k_key, top, BLOCK_V)
        hi = top_key
        for _ in range(32):
            mid = (p_key + hi + 1) >> 1
            if _mass_at_least(base, vocab, temperature, mid, k_key, top, BLOCK_V) >= target:
                p_key = mid
            else:
                hi = mid - 1

    floor = float("-inf")
    if min_p > 0.0:
        floor = top + tl.log(min_p)
    keep_key = tl.maximum(k_key, p_key)

    seed = tl.load(seeds_ptr + row)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_col = lanes
    for start in range(0, vocab, BLOCK_V):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) / temperature
        kept = (_order_key(x) >= keep_key) & (x >= floor) & (cols < vocab)
        # log(p / q) up to a constant; U = 0 gives q = inf and a score of -inf.
        score = tl.where(kept, x - tl.log(-tl.log(_uniform(seed, cols))), float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_col = tl.where(better, cols, best_col)
    winner = tl.min(tl.where(best == tl.max(best, 0), best_col, 2147483647), 0)
    tl.store(out_ptr + row, winner.to(tl.int64))


@triton.jit
def uniform_noise_kernel(seeds_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(out_ptr + row * vocab + cols, _uniform(seed, cols), mask=cols < vocab)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    block_v: int = 1024,
) -> torch.Tensor:
    """logits: [B, V] float32; temperature, top_p, min_p: [B] float32 (temperature 0 = greedy,
    top_p 1 and min_p 0 = off); top_k: [B] int32 (0 or >= V = off); seeds: [B] int64.
    Returns [B] int64 token ids."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        sample_kernel[(batch,)](
            logits,
            out,
            temperature,
            top_k,
            top_p,
            min_p,
            seeds,
            logits.stride(0),
            vocab,
            BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
        )
    return out


def uniform_noise(seeds: torch.Tensor, vocab: int, block_v: int = 1024) -> torch.Tensor:
    """[B, vocab]: the U that `sample` draws for these seeds (for tests and references)."""
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        uniform_noise_kernel[(seeds.shape[0],)](
            seeds, out, vocab, BLOCK_V=min(block_v, triton.next_power_of_2(vocab))
        )
    return out


def sample_ref(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    uniform: torch.Tensor,
) -> list[int]:
    """Row by row with a full sort, as engine.sampler's docstring specifies."""
    tokens = []
    for i, row in enumerate(logits.float().cpu()):
        if temperature[i] == 0.0:
            tokens.append(int(row.argmax()))
            continue
        row = row / temperature[i]
        vocab = row.numel()
        if 0 < top_k[i] < vocab:
            row = row.masked_fill(
                row < row.sort(descending=True).values[top_k[i] - 1], float("-inf")
            )
        if top_p[i] < 1.0:
            probs = row.softmax(-1)
            ranked = probs.sort(descending=True).values
            last = min(int((ranked.cumsum(-1) < top_p[i]).sum()), vocab - 1)
            row = row.masked_fill(probs < ranked[last], float("-inf"))
        if min_p[i] > 0.0:
            row = row.masked_fill(row.softmax(-1) < min_p[i] * row.softmax(-1).max(), float("-inf"))
        tokens.append(int((row.softmax(-1) / -uniform[i].cpu().log()).argmax()))
    return tokens
