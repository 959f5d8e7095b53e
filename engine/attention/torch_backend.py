"""Attention over the paged KV cache in torch: the CPU backend.

In float32 or bfloat16 with Folio's CPU kernels loaded, a layer's whole step is one call of Folio's
paged attention (engine/kernels/cpu/cpu_attention.cpp), which writes the new K/V and reads the
cache in place: decodes one query at a time, prefill and extend tokens in blocks (bfloat16 on CPUs
with AVX-512 BF16) or each as the decode of a context ending at itself. That beats
scaled_dot_product_attention at every prompt length measured (docs/quantization.md, "bfloat16 on
the CPU"). Otherwise, in plain torch: decodes (the first meta.num_decodes requests, one query token
each) run together, in a few groups of similar context length to limit padding, each group's blocks
gathered into one workspace and put through two batched matmuls; prefills and extends run one
request at a time through scaled_dot_product_attention. A sliding window (a layer's `window`) reads
only the blocks that hold a token's last `window` positions and masks the rest. Attention sinks
(gpt-oss) go to Folio's kernel as they are; in plain torch each sink is one more logit in its
head's softmax (one more key, of zero value, for scaled_dot_product_attention). A cache in
bfloat16 under float32 activations, or in an 8-bit float under either (--kv-cache-dtype), goes to
the kernel as it is; plain torch converts what it gathers, and the new K/V as the cache keeps them
(to_cache_dtype: the kernel's rounding and saturation). It must never
keep per-request K/V between steps; the gather workspace is scratch, overwritten every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.kv_dtype import copyable, to_cache_dtype
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu.capabilities import cpu_capabilities


@dataclass
class _DecodePlan:
    # Rows start:end of the batch; decodes are attended in groups of similar context length.
    start: int
    end: int
    # [num_reqs * blocks_per_req] block ids: each request's blocks from the first its window
    # sees (its first without a window), as many as the group's widest needs.
    block_ids: torch.Tensor
    # [num_reqs, 1, blocks_per_req * block_size] additive mask, -inf past each context length
    # and before its window.
    mask: torch.Tensor
    # [num_reqs, H, KVH * D], zero except each head's own KV-head slot; see _decode.
    q_blockdiag: torch.Tensor


@dataclass
class _PrefillPlan:
    start: int
    end: int
    # None when the request has no cached prefix: its new K/V are its whole context.
    block_ids: torch.Tensor | None
    # The context read: positions first .. seq_len (first > 0 only under a sliding window).
    first: int
    seq_len: int
    # [query_len, seq_len - first] additive causal (and windowed) mask aligned bottom-right;
    # None: plainly causal over the new K/V.
    mask: torch.Tensor | None


@dataclass
class _Plan:
    meta: AttentionMetadata
    decodes: list[_DecodePlan]
    prefills: list[_PrefillPlan]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, use_folio_kernels: bool = True) -> None:
        # This step's plans, per (metadata, window): a hybrid model's layers alternate between
        # their KV groups' metadata and windows.
        self._plans: dict[tuple[int, int | None], _Plan] = {}
        self._workspace = torch.empty(0)
        self._kernel = (
            torch.ops.folio_cpu_attention.paged_attention
            if use_folio_kernels and cpu_capabilities().folio_kernels
            else None
        )

    def prepare(self, meta: AttentionMetadata) -> None:
        # The runner may refill the same metadata object in place: never trust an old plan.
        self._plans.clear()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        if self._kernel is not None and self._kernel_fits(q):
            # The kernel writes the new K/V itself.
            return self._kernel(
                q,
                k,
                v,
                kv_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                window or 0,
                sinks,
            )

        cached_k, cached_v = to_cache_dtype(k, kv_cache.dtype), to_cache_dtype(v, kv_cache.dtype)
        slots = copyable(kv_cache.view(2, -1, k.shape[1], head_dim))
        slots[0].index_copy_(0, meta.slot_mapping, copyable(cached_k))
        slots[1].index_copy_(0, meta.slot_mapping, copyable(cached_v))
        if kv_cache.dtype != k.dtype:
            # A cache narrower than the activations (--kv-cache-dtype): the new tokens attend
            # to the values it keeps of them, as every later token does.
            k, v = cached_k.to(q.dtype), cached_v.to(q.dtype)
        plan = self._plans.get((id(meta), window))
        if plan is None or plan.meta is not meta:
            plan = self._plans[id(meta), window] = _make_plan(meta, q, k.shape[1], window)

        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        for d in plan.decodes:
            self._decode(q[d.start : d.end], kv_cache, d, scale, out[d.start : d.end], sinks)
        for p in plan.prefills:
            rows = slice(p.start, p.end)
            _prefill(q[rows], k[rows], v[rows], kv_cache, p, scale, out[rows], sinks)
        return out

    def decode_step_op(self, q: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        if self._kernel is None or not self._kernel_fits(q):
            return None
        return torch.ops.folio_cpu_attention.decode_step_attention

    @contextmanager
    def bound_decode_step(
        self, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
    ) -> Iterator[None]:
        if self._kernel is None:
            yield
            return
        ops = torch.ops.folio_cpu_attention
        ops.bind_decode_step(kv_caches, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        try:
            yield
        finally:
            ops.unbind_decode_step()

    @staticmethod
    def _kernel_fits(q: torch.Tensor) -> bool:
        return (
            q.dtype in (torch.float32, torch.bfloat16)
            and q.device.type == "cpu"
            and q.shape[-1] % 8 == 0
        )

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: _DecodePlan,
        scale: float,
        out: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> None:
        # One query per request. Gathered K of request b is a contiguous [L, KVH*D] matrix;
        # multiplying it by a block-diagonal query [H, KVH*D] (head h only in its KV head's
        # slot) scores all heads in one batched matmul that reads K where it lies; a matmul per
        # KV head would see strided K, which bf16 matmuls on CPU copy first. This spends KVH x
        # the (small) attention FLOPs and was measured 2-3x faster than per-head matmuls or SDPA.
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        ctx = plan.mask.shape[-1]
        size = 2 * batch * ctx * num_kv_heads * head_dim
        workspace = self._workspace
        if workspace.numel() < size or (workspace.dtype, workspace.device) != (
            kv_cache.dtype,
            kv_cache.device,
        ):
            workspace = self._workspace = torch.empty(
                size, dtype=kv_cache.dtype, device=kv_cache.device
            )
        kv = _gather_blocks(kv_cache, plan.block_ids, workspace[:size]).to(q.dtype)
        kv = kv.view(2, batch, ctx, num_kv_heads * head_dim)

        q_bd = plan.q_blockdiag
        _diagonal_blocks(q_bd, num_kv_heads, group, head_dim).copy_(
            q.view(batch, num_kv_heads, group, head_dim).permute(0, 2, 3, 1)
        )
        scores = torch.baddbmm(plan.mask, q_bd, kv[0].transpose(1, 2), alpha=scale)
        if sinks is not None:  # each head's sink: one more logit, dropped after the softmax
            sink_column = sinks.to(scores.dtype)[None, :, None].expand(batch, -1, 1)
            scores = torch.cat((scores, sink_column), dim=-1)
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
        if sinks is not None:
            probs = probs[..., :-1]
        mixed = torch.bmm(probs, kv[1])  # [B, H, KVH*D]; head h's answer sits in its own slot
        out.view(batch, num_kv_heads, group, head_dim).copy_(
            _diagonal_blocks(mixed, num_kv_heads, group, head_dim).permute(0, 3, 1, 2)
        )


def _gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """K and V of the listed blocks, in order: [2, len(block_ids), block_size * KVH * D]."""
    pool = kv_cache.view(2, kv_cache.shape[1], -1)
    shape = (2, block_ids.numel(), pool.shape[2])
    out = (
        torch.empty(shape, dtype=pool.dtype, device=pool.device) if out is None else out.view(shape)
    )
    # Two gathers along the first dimension copy about twice as fast as one along dim 1.
    torch.index_select(pool[0], 0, block_ids, out=out[0])
    torch.index_select(pool[1], 0, block_ids, out=out[1])
    return out


def _diagonal_blocks(t: torch.Tensor, num_kv_heads: int, group: int, head_dim: int) -> torch.Tensor:
    """View of [B, H, KVH*D] at each head's own KV-head slot, as [B, group, D, KVH]."""
    batch = t.shape[0]
    return torch.diagonal(
        t.view(batch, num_kv_heads, group, num_kv_heads, head_dim), dim1=1, dim2=3
    )


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: _PrefillPlan,
    scale: float,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    q4 = q.transpose(0, 1).unsqueeze(0)
    if sinks is not None:
        result = _attend_with_sinks(q4, k, v, kv_cache, plan, scale, sinks)
    elif plan.block_ids is None:
        # The whole context is new: causal from the top-left is causal from the bottom-right.
        result = F.scaled_dot_product_attention(
            q4,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=plan.mask,
            is_causal=plan.mask is None,
            scale=scale,
            enable_gqa=True,
        )
    else:
        ctx = _context(kv_cache, plan, q.dtype)
        result = F.scaled_dot_product_attention(
            q4,
            ctx[0].unsqueeze(0),
            ctx[1].unsqueeze(0),
            attn_mask=plan.mask,
            scale=scale,
            enable_gqa=True,
        )
    out.copy_(result[0].transpose(0, 1))


def _context(kv_cache: torch.Tensor, plan: _PrefillPlan, dtype: torch.dtype) -> torch.Tensor:
    """K and V of positions plan.first .. plan.seq_len from the cache, in `dtype` (the
    activations'): [2, KVH, ctx, D]."""
    assert plan.block_ids is not None
    num_kv_heads, head_dim = kv_cache.shape[3:]
    block_size = kv_cache.shape[2]
    ctx = _gather_blocks(kv_cache, plan.block_ids).to(dtype)
    skip = plan.first % block_size  # the gather starts at the first position's block
    ctx = ctx.view(2, -1, num_kv_heads, head_dim)[:, skip : skip + plan.seq_len - plan.first]
    return ctx.transpose(1, 2)


def _attend_with_sinks(
    q4: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: _PrefillPlan,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """scaled_dot_product_attention with each head's sink as one more key: zero K (its logit is
    the mask's, the sink itself) and zero V (it adds nothing to the output)."""
    if plan.block_ids is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
    else:
        keys, values = _context(kv_cache, plan, q4.dtype)
    num_heads, query_len = q4.shape[1], q4.shape[2]
    mask = plan.mask
    if mask is None:  # plainly causal over the new K/V
        visible = torch.ones(query_len, query_len, dtype=torch.bool, device=q4.device).tril_()
        mask = _additive_mask(visible, q4.dtype)
    sink_column = sinks.to(q4.dtype)[:, None, None].expand(num_heads, query_len, 1)
    mask = torch.cat((mask.expand(num_heads, *mask.shape[-2:]), sink_column), dim=-1)
    return F.scaled_dot_product_attention(
        q4,
        F.pad(keys, (0, 0, 0, 1)).unsqueeze(0),
        F.pad(values, (0, 0, 0, 1)).unsqueeze(0),
        attn_mask=mask.unsqueeze(0),
        scale=scale,
        enable_gqa=True,
    )


def _make_plan(
    meta: AttentionMetadata, q: torch.Tensor, num_kv_heads: int, window: int | None
) -> _Plan:
    """Everything about this step and window that does not depend on the layer, built once per
    step and window."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    dtype, device = q.dtype, q.device
    block_size = meta.block_size
    see = window or 0

    decodes = []
    n = meta.num_decodes
    for lo, hi in split_by_length(meta.seq_lens_cpu[:n]):
        lengths = meta.seq_lens_cpu[lo:hi]
        # Each request's first block read: where its window starts (its first block without).
        first_blocks = [max(0, length - see) // block_size if see else 0 for length in lengths]
        blocks = max(
            -(-length // block_size) - f for length, f in zip(lengths, first_blocks, strict=True)
        )
        first_t = torch.tensor(first_blocks, device=device)[:, None]
        columns = (first_t + torch.arange(blocks, device=device)).clamp_(
            max=meta.block_tables.shape[1] - 1
        )
        positions = (first_t * block_size + torch.arange(blocks * block_size, device=device))[
            :, None, :
        ]
        seq_lens = meta.seq_lens[lo:hi, None, None]
        visible = positions < seq_lens
        if see:
            visible &= positions >= seq_lens - see
        decodes.append(
            _DecodePlan(
                start=lo,
                end=hi,
                block_ids=meta.block_tables[lo:hi].gather(1, columns).reshape(-1),
                mask=_additive_mask(visible, dtype),
                q_blockdiag=torch.zeros(
                    (hi - lo, num_heads, num_kv_heads * head_dim), dtype=dtype, device=device
                ),
            )
        )

    prefills = []
    start = sum(meta.query_lens_cpu[:n])
    for i in range(n, meta.num_reqs):
        query_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        cached = seq_len - query_len
        # The first position the request's first query token sees.
        first = max(0, cached - see + 1) if see else 0
        block_ids = mask = None
        if cached:
            block_ids = meta.block_tables[i, first // block_size : -(-seq_len // block_size)]
        if cached or see:
            rows = torch.arange(cached, seq_len, device=device)[:, None]
            keys = torch.arange(first, seq_len, device=device)[None, :]
            visible = keys <= rows
            if see:
                visible &= keys > rows - see
            mask = _additive_mask(visible, dtype)
        prefills.append(_PrefillPlan(start, start + query_len, block_ids, first, seq_len, mask))
        start += query_len
    return _Plan(meta, decodes, prefills)


def split_by_length(lengths: list[int], depth: int = 2, min_rows: int = 8) -> list[tuple[int, int]]:
    """Contiguous row ranges whose padded area (rows x longest context) is much smaller than
    padding the whole batch to its longest context; at most 2**depth ranges.

    Each extra range costs a handful of ops per layer, so a split must save a fifth of the
    area. Decodes arrive sorted by length (the runner orders them), where this works best;
    any order stays correct.
    """
    n = len(lengths)
    if n == 0:
        return []
    whole = n * max(lengths)
    if depth == 0 or n < 2 * min_rows:
        return [(0, n)]
    prefix_max, suffix_max = list(lengths), list(lengths)
    for i in range(1, n):
        prefix_max[i] = max(prefix_max[i - 1], lengths[i])
        suffix_max[n - 1 - i] = max(suffix_max[n - i], lengths[n - 1 - i])
    best_cost, best_k = whole, 0
    for k in range(min_rows, n - min_rows + 1):
        cost = k * prefix_max[k - 1] + (n - k) * suffix_max[k]
        if cost < best_cost:
            best_cost, best_k = cost, k
    if best_cost > 0.8 * whole:
        return [(0, n)]
    left = split_by_length(lengths[:best_k], depth - 1, min_rows)
    right = split_by_length(lengths[best_k:], depth - 1, min_rows)
    return left + [(lo + best_k, hi + best_k) for lo, hi in right]


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))
