"""Causal attention over the paged KV cache: decode (one query token per request) and
prefill/extend (a ragged batch of query tokens per request), with grouped-query attention.

One kernel serves both. A program owns one KV head of one request and a tile of its query
tokens; its rows are (token, query head of that KV head's group) pairs, so every K/V tile read
from the pool serves the whole group. Heads are padded to a power of two with masked rows (9
heads over 3 KV heads is a group of 3, padded to 4), and head sizes to a power of two of at
least 16 with masked columns. Context positions are read one at a time through the block table
(pool slot = table[pos // block_size] * block_size + pos % block_size), so any power-of-two
block size and any scatter of blocks work, and a request's cached prefix and its new tokens
(already written to the cache) are read the same way. With a sliding window a token sees only
its last `window` positions: a tile reads from the first position its first token sees. Softmax
is online (running max and sum), in float32; with attention sinks (gpt-oss) each head's sink
starts it, as a logit whose value contributes nothing. This module never writes the KV cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def paged_attention_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale_log2,  # softmax scale times log2(e): the kernel exponentiates in base 2
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    table_stride,
    v_offset,  # row stride of the block table; elements from the K pool to the V pool
    window,  # a token sees this many positions, itself included; 0: all of them
    sinks_ptr,  # [H] each head's sink logit (read only with HAS_SINKS)
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DECODE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    req = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    if DECODE:  # query row b is request b's only token; query_start_ptr is unused
        q_start = req
        q_len = 1
    else:
        q_start = tl.load(query_start_ptr + req)
        q_len = tl.load(query_start_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)

    rows = tl.arange(0, BLOCK_M * GROUP_P)
    token = tile * BLOCK_M + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (token < q_len) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_start + token)[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale_log2
    # Query token j of the request sits at position seq_len - q_len + j and sees 0 .. itself.
    q_pos = seq_len - q_len + token

    m_i = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P], tl.float32)
    if HAS_SINKS:
        # The sink is the first logit seen (in base 2, as the scores): the maximum so far, and
        # exp2(0) = 1 in the sum; it adds nothing to acc.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_i = sink * 1.4426950408889634
        l_i = tl.full([BLOCK_M * GROUP_P], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P, HEAD_DIM_P], tl.float32)
    # The tile's last token sees the most; nothing past it is read, nor anything before what
    # its first token's window sees.
    end = tl.minimum(seq_len - q_len + (tile + 1) * BLOCK_M, seq_len)
    begin = 0
    if window > 0:
        begin = tl.maximum(seq_len - q_len + tile * BLOCK_M - window + 1, 0)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(
            block_tables_ptr + req * table_stride + pos // BLOCK_SIZE, mask=pos_ok, other=0
        )
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # Without a window position 0 is in the first tile and visible to every row, so m_new
        # is finite from the first iteration on; with one, a row may see nothing in a tile
        # before its window: its maximum stands at 0 there, so that no row ever computes
        # exp2(-inf - -inf).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + v_offset + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_offs = (
        (q_start + token)[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :]
    )
    tl.store(
        out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
    )


def _dot_precision(dtype: torch.dtype) -> str:
    # 16-bit values are exact in tf32, so tf32 tensor cores lose nothing on them (the P @ V
    # product rounds P to 10 bits, finer than a bf16 kernel would); float32 models get ieee.
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float,
    out: torch.Tensor | None,
    num_tiles: int,
    block_m: int,
    group_p: int,
    block_n: int,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert kv_cache.is_contiguous() and q.stride(2) == 1 and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.stride(2) == 1
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0:
        return out
    grid = (num_reqs, num_tiles, num_kv_heads)
    paged_attention_kernel[grid](
        q,
        out,
        kv_cache,
        block_tables,
        seq_lens,
        seq_lens if query_start_loc is None else query_start_loc,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(0),
        window or 0,
        q if sinks is None else sinks,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
        DECODE=query_start_loc is None,
        HAS_SINKS=sinks is not None,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, H, D], request b's only query token (at position seq_lens[b] - 1); kv_cache:
    [2, num_blocks, block_size, KVH, D]; block_tables: [B, max_blocks] int32; seq_lens: [B]
    int32; a sliding `window` (None: all); `sinks` [H], each head's attention-sink logit (None:
    none). Returns out ([B, H, D], q's dtype), filled."""
    group = q.shape[1] // kv_cache.shape[3]
    # One token per program: the group's heads fill the rows, at least 16 of them for tl.dot.
    group_p = max(16, triton.next_power_of_2(group))
    return _launch(
        q, kv_cache, block_tables, seq_lens, None, scale, out, 1, 1, group_p, block_n, window, sinks
    )


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    rows_per_tile: int = 64,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Request i's query tokens are q[query_start_loc[i]:query_start_loc[i + 1]] (absolute rows
    of q, which may hold other rows too: those are left alone in out); they are the last tokens
    of its context of seq_lens[i] tokens, all of which (new ones included) are already in the
    cache. max_query_len bounds the query lengths (a host int: no device sync). Returns out."""
    group_p = triton.next_power_of_2(q.shape[1] // kv_cache.shape[3])
    block_m = max(1, rows_per_tile // group_p)
    group_p = max(group_p, 16 // block_m)
    num_tiles = triton.cdiv(max_query_len, block_m)
    return _launch(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        out,
        num_tiles,
        block_m,
        group_p,
        block_n,
        window,
        sinks,
    )


def paged_prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 loop reference over requests laid out back to back in q: gathers each context
    token by token through its block table and applies a bottom-right-aligned causal mask (and
    the sliding window's); with `sinks`, each head's sink is one more logit in its softmax,
    dropped after it (as transformers' gpt-oss computes it)."""
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32)
    start = 0
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        kv = kv_cache.float().cpu().flatten(1, 2)[:, slots]  # [2, seq_len, KVH, D]
        k = kv[0].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, D]
        v = kv[1].repeat_interleave(group, dim=1).transpose(0, 1)
        qr = q[start : start + q_len].float().cpu().transpose(0, 1)  # [H, q_len, D]
        scores = qr @ k.transpose(1, 2) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink_column = sinks.float().cpu()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start : start + q_len] = (probs @ v).transpose(0, 1)
        start += q_len
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_prefill_attention_ref(
        q, kv_cache, [1] * len(seq_lens), seq_lens, block_tables, scale, window, sinks
    )
