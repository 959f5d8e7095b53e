"""The torch attention backend against a plain per-request reference on random data."""

from __future__ import annotations

import contextlib
import math
import weakref

import pytest
import torch

from engine.attention.kv_dtype import to_cache_dtype
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.layers.attention import get_attention_backend
from paged import BlockPool, build_metadata, outside_window


def reference_attention(q, keys, values, query_lens, seq_lens, scale, window=None, sinks=None):
    """Per request, per query token, per head: an explicit softmax over contiguous K/V (the
    last `window` positions of it under a sliding window), with each head's sink logit in its
    denominator where there are `sinks`."""
    num_heads = q.shape[1]
    group = num_heads // keys[0].shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    token = 0
    for k, v, q_len, s_len in zip(keys, values, query_lens, seq_lens, strict=False):
        for j in range(q_len):
            last = s_len - q_len + j  # the newest position this token may see
            first = max(0, last - window + 1) if window else 0
            for h in range(num_heads):
                scores = [
                    scale * float(q[token, h].double() @ k[p, h // group].double())
                    for p in range(first, last + 1)
                ]
                sink = [] if sinks is None else [float(sinks[h])]
                top = max(scores + sink)
                weights = torch.tensor([math.exp(s - top) for s in scores], dtype=torch.float64)
                weights /= weights.sum() + sum(math.exp(s - top) for s in sink)
                out[token, h] = weights @ v[first : last + 1, h // group].double()
            token += 1
    return out


def run_case(
    query_lens,
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
    seed=0,
    folio_kernels: bool | str = True,
    window=None,
    sinks=None,
    cache_dtype=None,
):
    """Builds a pool with prefixes already cached, runs two layers through one backend, checks
    both. q, k and v are views of one fused tensor, as the model's projections hand them over.
    Under a sliding window, the blocks before each request's window are a NaN-filled block in
    its table (the last of the pool), which must never be read. `sinks`: each head's
    attention-sink logit (gpt-oss). `folio_kernels`: Folio's kernels (True), held to their AVX2
    code ("avx2"), or torch's ops (False). `cache_dtype`: the cache's, where it is not `dtype`
    (--kv-cache-dtype bfloat16, fp8*): K and V then hold values it represents, so the
    reference's tolerance stays the activations' dtype's."""
    torch.manual_seed(seed)
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 7
    pool = BlockPool(num_blocks - 1, seed=seed)
    tables = [pool.grow([], s, block_size) for s in seq_lens]
    seen = tables
    if window:
        seen = outside_window(tables, query_lens, seq_lens, window, block_size, num_blocks - 1)
    meta = build_metadata(query_lens, seq_lens, seen, block_size)
    # The runner's tables are the first columns of a wider buffer: rows are strided.
    columns = meta.block_tables.shape[1]
    meta.block_tables = torch.nn.functional.pad(meta.block_tables, (0, 3))[:, :columns]
    scale = head_dim**-0.5
    backend = TorchAttentionBackend(use_folio_kernels=bool(folio_kernels))
    backend.prepare(meta)

    for _layer in range(2):
        # Finite garbage everywhere, so padded and stale slots must really be masked.
        cached = cache_dtype or dtype
        cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cached)
        cache[:, -1] = float("nan")
        keys = [torch.randn(s, num_kv_heads, head_dim).to(cached).to(dtype) for s in seq_lens]
        values = [torch.randn(s, num_kv_heads, head_dim).to(cached).to(dtype) for s in seq_lens]
        for k, v, q_len, s_len, table in zip(
            keys, values, query_lens, seq_lens, tables, strict=False
        ):
            for pos in range(s_len - q_len):  # the cached prefix
                cache[0, table[pos // block_size], pos % block_size] = k[pos]
                cache[1, table[pos // block_size], pos % block_size] = v[pos]
        before = cache.clone()
        new_k = torch.cat([k[s - q :] for k, q, s in zip(keys, query_lens, seq_lens, strict=False)])
        new_v = torch.cat(
            [v[s - q :] for v, q, s in zip(values, query_lens, seq_lens, strict=False)]
        )
        q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
        fused = torch.cat((q, new_k, new_v), dim=1)
        q, new_k, new_v = fused.split([num_heads, num_kv_heads, num_kv_heads], dim=1)

        with kernels_isa("avx2") if folio_kernels == "avx2" else contextlib.nullcontext():
            out = backend.forward(q, new_k, new_v, cache, meta, scale, window, sinks)

        flat = cache.view(2, -1, num_kv_heads, head_dim)
        assert torch.equal(flat[0, meta.slot_mapping], new_k.to(cached))
        assert torch.equal(flat[1, meta.slot_mapping], new_v.to(cached))
        untouched = torch.ones(flat.shape[1], dtype=torch.bool)
        untouched[meta.slot_mapping] = False
        torch.testing.assert_close(
            flat[:, untouched],
            before.view(2, -1, num_kv_heads, head_dim)[:, untouched],
            atol=0,
            rtol=0,
            equal_nan=True,
        )

        expected = reference_attention(q, keys, values, query_lens, seq_lens, scale, window, sinks)
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
        if sinks is not None:  # they matter here
            without = reference_attention(q, keys, values, query_lens, seq_lens, scale, window)
            assert not torch.allclose(without, expected, atol=10 * tol)


# Decodes first (contexts: 1, a block multiple, not multiples), then a fresh prefill, an extend
# whose cached prefix is longer than its new tokens, and one whose prefix is shorter.
MIXED = dict(query_lens=[1, 1, 1, 1, 7, 3, 9], seq_lens=[1, 16, 5, 37, 7, 29, 13])


AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"


@contextlib.contextmanager
def kernels_isa(isa: str):
    """FOLIO_CPU_ISA for the kernel calls inside (the kernels read it at every call): "avx2"
    holds a CPU with AVX-512 to the AVX2 code."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FOLIO_CPU_ISA", isa)
        yield


# Decodes through Folio's paged decode kernel (in AVX-512 vectors where the CPU has them, and
# held to AVX2 there too), and through plain torch.
KERNEL_PATHS = [
    pytest.param(
        True,
        id="folio-kernel",
        marks=pytest.mark.skipif(
            not cpu_capabilities().folio_kernels, reason="this CPU has no AVX2 or no C++ compiler"
        ),
    ),
    pytest.param(
        "avx2",
        id="folio-kernel-avx2",
        marks=pytest.mark.skipif(
            not (cpu_capabilities().folio_kernels and AVX512),
            reason="the kernels' AVX2 code is the one above on a CPU without AVX-512",
        ),
    ),
    pytest.param(False, id="torch"),
]


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliding_window_reads_only_the_window(dtype, folio_kernels):
    # Windows of 5 over blocks of 4: decodes inside and past it, a fresh prompt longer than it,
    # extends whose new tokens start inside or past it.
    run_case(
        **MIXED,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=4,
        dtype=dtype,
        folio_kernels=folio_kernels,
        window=5,
    )


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS)
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_sinks(dtype, window, folio_kernels):
    """gpt-oss's sinks (one more logit per head, of no value) on decodes, a fresh prefill and
    extends, with and without a window. In bfloat16 with 48 features a prompt's tokens go to the
    kernel's prefill blocks on CPUs with AVX-512 BF16 (whole tiles of 16), token by token
    elsewhere and under the window."""
    # Sinks as large as the scores, so that they move every row's weights; as bfloat16 values
    # the model's own sinks are handed over as they are (the kernel widens them).
    sinks = (2 * torch.randn(6, generator=torch.Generator().manual_seed(7))).to(dtype)
    run_case(
        **MIXED,
        num_heads=6,
        num_kv_heads=2,
        head_dim=48,
        block_size=4,
        dtype=dtype,
        folio_kernels=folio_kernels,
        window=window,
        sinks=sinks,
    )


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_reference(
    num_heads, num_kv_heads, head_dim, block_size, folio_kernels
):
    run_case(
        **MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        folio_kernels=folio_kernels,
    )


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        # 2,000 positions x 9 heads: enough work for the kernel to split over threads.
        pytest.param([1] * 6, [300, 1, 77, 16, 129, 2000], id="decodes"),
        # A prefill and an extend long enough to split too, in blocks of tokens or token by
        # token.
        pytest.param([1, 120, 24], [50, 120, 64], id="prefill-and-extend"),
    ],
)
def test_gqa_like_smollm2(query_lens, seq_lens, dtype, folio_kernels):
    run_case(
        query_lens,
        seq_lens,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        folio_kernels=folio_kernels,
    )


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 40, 48])
def test_pairs_of_heads_and_short_head_dims(head_dim, dtype, folio_kernels):
    # Two query heads to a KV head, and head dims whose last slab of 32 features is partial;
    # in bfloat16, 48 features make whole tiles of 16 for prefill blocks, 24 and 40 do not.
    run_case(
        **MIXED,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        folio_kernels=folio_kernels,
    )


@pytest.mark.skipif(
    not cpu_capabilities().folio_kernels, reason="this CPU has no AVX2 or no C++ compiler"
)
def test_paged_attention_names_bad_step_tables():
    block_size, num_blocks = 16, 4
    pool = BlockPool(num_blocks, seed=3)
    meta = build_metadata([3, 1], [3, 9], [pool.grow([], s, block_size) for s in (3, 9)], 16)
    cache = torch.zeros(2, num_blocks, block_size, 2, 64)
    q, k, v = torch.randn(4, 4, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    op = torch.ops.folio_cpu_attention.paged_attention
    tables = (meta.slot_mapping, meta.block_tables)
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0 to the number"):
        op(q, k, v, cache, *tables, torch.tensor([0, 3, 5], dtype=torch.int32), meta.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="request 0 has 3 query tokens and a context of 2"):
        op(q, k, v, cache, *tables, meta.query_start_loc, torch.tensor([2, 9]).int(), 1.0)
    with pytest.raises(RuntimeError, match="request 1 has context length 99, outside its block"):
        op(q, k, v, cache, *tables, meta.query_start_loc, torch.tensor([3, 99]).int(), 1.0)


def test_prefill_only():
    run_case([5, 12, 1], [5, 20, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4)


def test_single_token_prefill_counts_as_decode():
    # A one-token prompt and a one-token extend are decodes by the metadata's rule.
    run_case([1, 1, 4], [1, 6, 4], num_heads=6, num_kv_heads=2, head_dim=64, block_size=4)


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, folio_kernels):
    # bfloat16 decodes go through the kernel when it loads; float16 ones always through torch.
    run_case(
        **MIXED,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        folio_kernels=folio_kernels,
    )


@pytest.mark.skipif(
    not cpu_capabilities().folio_kernels, reason="this CPU has no AVX2 or no C++ compiler"
)
def test_bfloat16_kernel_is_the_float32_kernel_rounded_once():
    """bfloat16 inputs are widened exactly and the float32 result rounded once at the end: the
    output is the float32 kernel's on the same values, rounded to bfloat16 (at most one unit in
    the last place apart, where summation order moves a value across a rounding boundary)."""
    seq_lens, block_size, num_blocks = [3, 40, 17, 200], 16, 24
    pool = BlockPool(num_blocks, seed=2)
    meta = build_metadata(
        [1] * 4, seq_lens, [pool.grow([], s, block_size) for s in seq_lens], block_size
    )
    torch.manual_seed(3)
    cache = torch.randn(2, num_blocks, block_size, 3, 64).bfloat16()
    q, k, v = (torch.randn(4, heads, 64).bfloat16() for heads in (9, 3, 3))
    kernel = torch.ops.folio_cpu_attention.paged_decode_attention
    wide_cache = cache.float()
    expected = kernel(q.float(), k.float(), v.float(), wide_cache, *_tables(meta), 0.125).bfloat16()
    out = kernel(q, k, v, cache, *_tables(meta), 0.125)
    assert out.dtype == torch.bfloat16
    assert torch.equal(cache.float(), wide_cache)  # the same K/V written, bit for bit
    ulp = (expected.float().abs() * 2**-7).clamp(min=2**-133)
    assert ((out.float() - expected.float()).abs() <= ulp).all()
    assert (out == expected).float().mean() > 0.9


FOLIO_KERNELS_ONLY = pytest.mark.skipif(
    not cpu_capabilities().folio_kernels, reason="this CPU has no AVX2 or no C++ compiler"
)


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS[:2])
@pytest.mark.parametrize("window", [None, 300], ids=["full", "window300"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_contexts_attend_in_chunks_with_sinks_and_windows(dtype, window, folio_kernels):
    """Tokens seeing more positions than a chunk (256) attend them chunk by chunk and merge the
    chunks: decodes one position past a chunk, several chunks and a short last one, and an
    extend's tokens, with sinks, under a window longer than a chunk and without, against the
    reference."""
    # Sinks as large as the log of a thousand positions' weights, so that they still matter.
    sinks = (7 + 2 * torch.randn(6, generator=torch.Generator().manual_seed(9))).to(dtype)
    run_case(
        query_lens=[1, 1, 1, 3],
        seq_lens=[257, 1000, 40, 700],
        num_heads=6,
        num_kv_heads=2,
        head_dim=48,
        block_size=16,
        dtype=dtype,
        window=window,
        sinks=sinks,
        folio_kernels=folio_kernels,
    )


# (activations, the cache's dtype) --kv-cache-dtype allows beyond the activations' own.
NARROWER_CACHES = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e5m2),
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
]


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS)
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize(("dtype", "cache_dtype"), NARROWER_CACHES, ids=str)
def test_a_narrower_cache_than_the_rows(dtype, cache_dtype, window, folio_kernels):
    """--kv-cache-dtype bfloat16 under float32 activations, fp8 (e4m3, e5m2) under float32 or
    bfloat16: the new K/V are written as the cache keeps them, and every kind of row (decodes,
    a fresh prefill, extends; GQA, sinks, a window) attends over the cache against the float64
    reference, on Folio's kernels and torch's ops."""
    sinks = (1 + torch.randn(8, generator=torch.Generator().manual_seed(3))).float()
    for case_sinks in (None, sinks):
        run_case(
            **MIXED,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            block_size=16,
            dtype=dtype,
            window=window,
            sinks=case_sinks,
            folio_kernels=folio_kernels,
            cache_dtype=cache_dtype,
        )


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS[:2])
@pytest.mark.parametrize("cache_dtype", [c for d, c in NARROWER_CACHES if d == torch.float32])
def test_a_narrower_cache_is_the_float32_kernel_on_its_values(
    cache_dtype, folio_kernels, monkeypatch
):
    """Float32 rows over a bfloat16 or fp8 cache widen each cached value exactly: their outputs
    have the bits of the float32 kernel over a float32 cache holding the same values, for decodes
    (alone, chunked, a verification step's groups) and an extend's tokens, with the new K/V
    rounded to nearest even as they are written (fp8's largest finite value where they are past
    it, as to_cache_dtype, torch's ops' path, gives them). Bfloat16 rows over an fp8 cache are
    bfloat16 rows over a bfloat16 cache of the same values."""
    if folio_kernels == "avx2":
        monkeypatch.setenv("FOLIO_CPU_ISA", "avx2")
    block_size, num_blocks = 16, 300
    pool = BlockPool(num_blocks, seed=8)
    torch.manual_seed(9)
    narrow = torch.randn(2, num_blocks, block_size, 3, 64).to(cache_dtype)
    wide = narrow.float()
    ops = torch.ops.folio_cpu_attention
    seq_lens = [5, 300, 1000, 1001, 1002, 1003, 40]  # 1000..1003: one request's draft rows
    tables = [pool.grow([], s, block_size) for s in seq_lens[:3]]
    tables += [tables[2]] * 3 + [pool.grow([], seq_lens[-1], block_size)]
    decodes = build_metadata([1] * len(seq_lens), seq_lens, tables, block_size)

    def new_rows(count: int) -> tuple[torch.Tensor, ...]:
        q, k, v = (torch.randn(count, heads, 64) for heads in (9, 3, 3))
        if cache_dtype.itemsize == 1:  # past fp8's range
            k[0, 0, :4] = torch.tensor([1e5, -1e5, 500.0, float("inf")])
        return q, k, v

    def kept(x: torch.Tensor) -> torch.Tensor:  # what the cache keeps of x, widened
        return to_cache_dtype(x, cache_dtype).to(x.dtype)

    q, k, v = new_rows(len(seq_lens))
    out = ops.paged_decode_attention(q, k, v, narrow, *_tables(decodes), 0.125)
    expected = ops.paged_decode_attention(q, kept(k), kept(v), wide, *_tables(decodes), 0.125)
    assert out.dtype == torch.float32 and torch.equal(out, expected) and out.isfinite().all()
    assert torch.equal(narrow.float(), wide)  # the same values written, bit for bit
    if cache_dtype != torch.bfloat16:
        halves = narrow.bfloat16()
        q, k, v = (x.bfloat16() for x in new_rows(len(seq_lens)))
        out = ops.paged_decode_attention(q, k, v, narrow, *_tables(decodes), 0.125)
        expected = ops.paged_decode_attention(q, kept(k), kept(v), halves, *_tables(decodes), 0.125)
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
        assert torch.equal(narrow.bfloat16(), halves)
        wide = narrow.float()
    extend = build_metadata([4], [seq_lens[1] + 3], [pool.grow(tables[1], 303, block_size)], 16)
    q, k, v = new_rows(4)
    args = (extend.slot_mapping, extend.block_tables, extend.query_start_loc, extend.seq_lens)
    out = ops.paged_attention(q, k, v, narrow, *args, 0.125)
    expected = ops.paged_attention(q, kept(k), kept(v), wide, *args, 0.125)
    assert torch.equal(out, expected)
    assert torch.equal(narrow.float(), wide)
    with pytest.raises(RuntimeError, match="the cache in their dtype, in bfloat16 or in float8"):
        ops.paged_decode_attention(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), wide, *_tables(extend), 0.125
        )


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS[:2])
def test_a_tokens_output_bits_do_not_depend_on_its_step(folio_kernels, monkeypatch):
    """A token's attention is chunked by its own context alone: its output has the same bits
    decoded alone, in a batch of other rows (short and long), and as an extend's last token; in
    AVX-512 vectors and held to AVX2 alike."""
    if folio_kernels == "avx2":
        monkeypatch.setenv("FOLIO_CPU_ISA", "avx2")
    block_size, num_blocks = 16, 200
    seq_lens = [900, 40, 600, 300, 1200]
    pool = BlockPool(num_blocks, seed=4)
    tables = [pool.grow([], s, block_size) for s in seq_lens]
    torch.manual_seed(5)
    cache = torch.randn(2, num_blocks, block_size, 3, 64)
    q, k, v = (torch.randn(len(seq_lens), heads, 64) for heads in (9, 3, 3))
    decode = torch.ops.folio_cpu_attention.paged_decode_attention
    batch = build_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    together = decode(q, k, v, cache, *_tables(batch), 0.125)
    for i, (length, table) in enumerate(zip(seq_lens, tables, strict=True)):
        alone = build_metadata([1], [length], [table], block_size)
        out = decode(q[i : i + 1], k[i : i + 1], v[i : i + 1], cache, *_tables(alone), 0.125)
        assert torch.equal(out[0], together[i]), i
    # The 600-position row as the last of three new tokens (the two before it its own
    # positions 597 and 598, already in the cache).
    extend = build_metadata([3], [600], [tables[2]], block_size)
    slots = extend.slot_mapping
    cached = cache.view(2, -1, 3, 64)[:, slots[:2]]
    out = torch.ops.folio_cpu_attention.paged_attention(
        torch.cat((torch.randn(2, 9, 64), q[2:3])),
        torch.cat((cached[0], k[2:3])),
        torch.cat((cached[1], v[2:3])),
        cache,
        slots,
        extend.block_tables,
        extend.query_start_loc,
        extend.seq_lens,
        0.125,
    )
    assert torch.equal(out[2], together[2])


def _tables(meta):
    return meta.slot_mapping, meta.block_tables, meta.seq_lens


@pytest.mark.parametrize("folio_kernels", KERNEL_PATHS[:2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_requests_rows_attend_as_groups_with_the_bits_each_has_alone(
    dtype, folio_kernels, monkeypatch
):
    """A verification step's rows (one request's consecutive positions through one table) and a
    float32 extend's tokens attend in groups that read the context once: each row's output has
    the bits it has decoded alone, across a chunk's end, over several chunks, in groups of
    several sizes (two threads: groups form where there are chunks enough for them)."""
    if folio_kernels == "avx2":
        monkeypatch.setenv("FOLIO_CPU_ISA", "avx2")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        block_size, num_blocks = 16, 400
        pool = BlockPool(num_blocks, seed=6)
        torch.manual_seed(7)
        cache = torch.randn(2, num_blocks, block_size, 3, 64).to(dtype)
        decode = torch.ops.folio_cpu_attention.paged_decode_attention
        for first, rows in ((250, 9), (1020, 7), (3, 5), (512, 16)):
            table = pool.grow([], first + rows - 1, block_size)
            q, k, v = (torch.randn(rows, heads, 64).to(dtype) for heads in (9, 3, 3))
            lengths = [first + r for r in range(rows)]
            step = build_metadata([1] * rows, lengths, [table] * rows, block_size)
            together = decode(q, k, v, cache, *_tables(step), 0.125)
            for r, length in enumerate(lengths):
                alone = build_metadata([1], [length], [table], block_size)
                one = decode(
                    q[r : r + 1], k[r : r + 1], v[r : r + 1], cache, *_tables(alone), 0.125
                )
                assert torch.equal(one[0], together[r]), (first, r)
            if dtype != torch.float32:
                continue  # bfloat16 extends go through the prefill blocks' tiles
            extend = build_metadata([rows], [lengths[-1]], [table], block_size)
            out = torch.ops.folio_cpu_attention.paged_attention(
                q,
                k,
                v,
                cache,
                extend.slot_mapping,
                extend.block_tables,
                extend.query_start_loc,
                extend.seq_lens,
                0.125,
            )
            assert torch.equal(out, together), first
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(
    not (cpu_capabilities().folio_kernels and AVX512), reason="this CPU has no AVX-512"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decodes_in_avx512_vectors_where_the_cpu_has_them(dtype, monkeypatch):
    """A CPU with AVX-512 decodes in 16-float vectors: other sums than AVX2's (FOLIO_CPU_ISA=avx2
    holds it to those: float32 outputs differ in their last bits), the same attention within
    rounding; a head_dim that is not a multiple of 16 stays on AVX2's 8-float vectors."""
    decode = torch.ops.folio_cpu_attention.paged_decode_attention
    for head_dim, differs in ((64, True), (40, False)):
        seq_lens = [300, 17, 1000]
        pool = BlockPool(120, seed=2)
        tables = [pool.grow([], s, 16) for s in seq_lens]
        torch.manual_seed(3)
        cache = torch.randn(2, 120, 16, 2, head_dim).to(dtype)
        q, k, v = (torch.randn(3, heads, head_dim).to(dtype) for heads in (6, 2, 2))
        meta = build_metadata([1, 1, 1], seq_lens, tables, 16)
        wide = decode(q, k, v, cache, *_tables(meta), 0.1)
        monkeypatch.setenv("FOLIO_CPU_ISA", "avx2")
        narrow = decode(q, k, v, cache, *_tables(meta), 0.1)
        monkeypatch.delenv("FOLIO_CPU_ISA")
        if dtype == torch.float32:  # bfloat16 outputs round most of the difference away
            assert torch.equal(wide, narrow) is not differs, head_dim
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(wide.float(), narrow.float(), atol=tol, rtol=tol)


def test_prepare_invalidates_plan_for_reused_metadata():
    """A runner may refill one metadata object in place; prepare must drop the old plan."""
    block_size, heads, kv_heads, dim = 4, 4, 2, 64
    pool = BlockPool(32)
    table = pool.grow([], 9, block_size)
    meta = build_metadata([1], [5], [table], block_size)
    backend = TorchAttentionBackend()
    cache = torch.randn(2, 32, block_size, kv_heads, dim)
    backend.prepare(meta)
    backend.forward(
        torch.randn(1, heads, dim),
        torch.randn(1, kv_heads, dim),
        torch.randn(1, kv_heads, dim),
        cache,
        meta,
        0.125,
    )

    refilled = build_metadata([1], [9], [table], block_size)
    for name in ("slot_mapping", "seq_lens", "seq_lens_cpu", "block_tables", "max_seq_len"):
        setattr(meta, name, getattr(refilled, name))
    backend.prepare(meta)
    q, k, v = (
        torch.randn(1, heads, dim),
        torch.randn(1, kv_heads, dim),
        torch.randn(1, kv_heads, dim),
    )
    out = backend.forward(q, k, v, cache, meta, 0.125)
    flat = cache.view(2, -1, kv_heads, dim)
    ctx_slots = [table[p // block_size] * block_size + p % block_size for p in range(9)]
    expected = reference_attention(q, [flat[0, ctx_slots]], [flat[1, ctx_slots]], [1], [9], 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_backend_selection():
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


def test_triton_backend_needs_cuda_or_the_interpreter():
    """Outside the test session's interpreter mode, asking for triton on CPU is a clear error."""
    import os
    import subprocess
    import sys

    code = (
        "from engine.layers.attention import get_attention_backend; "
        "get_attention_backend('triton', 'cpu')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "needs a CUDA device" in result.stderr


@pytest.mark.skipif(
    not cpu_capabilities().folio_kernels, reason="this CPU has no AVX2 or no C++ compiler"
)
def test_decode_step_op_reads_the_bound_step():
    """What a compiled decode program calls: layer i's attention over the cache and tables of
    the step bound around it, equal to the backend's own call; nothing is kept after it."""
    seq_lens, block_size, num_blocks = [3, 40, 17], 16, 12
    pool = BlockPool(num_blocks, seed=1)
    meta = build_metadata(
        [1] * 3, seq_lens, [pool.grow([], s, block_size) for s in seq_lens], block_size
    )
    caches = [torch.randn(2, num_blocks, block_size, 3, 64) for _ in range(2)]
    expected_caches = [cache.clone() for cache in caches]
    q, k, v = torch.randn(3, 9, 64), torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    backend = TorchAttentionBackend()
    op = backend.decode_step_op(q)
    assert backend.decode_step_op(q.bfloat16()) is not None
    assert op is not None and backend.decode_step_op(q.half()) is None

    backend.prepare(meta)
    expected = backend.forward(q, k, v, expected_caches[1], meta, 0.125)
    with backend.bound_decode_step(meta, caches):
        out = op(q, k, v, 1, 0.125)
        with pytest.raises(RuntimeError, match="no decode step bound with a cache for layer 2"):
            op(q, k, v, 2, 0.125)
    assert torch.equal(out, expected)
    # Layer 1's new K/V written as the backend writes them; layer 0's cache untouched.
    assert torch.equal(caches[1], expected_caches[1])
    assert torch.equal(caches[0], expected_caches[0])
    # A sliding layer with sinks (gpt-oss's): the window and the sinks as the backend takes them.
    sinks = torch.randn(9)
    expected = backend.forward(q, k, v, expected_caches[0], meta, 0.125, 5, sinks)
    with backend.bound_decode_step(meta, caches):
        assert torch.equal(op(q, k, v, 0, 0.125, 5, sinks), expected)
        with pytest.raises(RuntimeError, match=r"one logit per query head: \[9\], got \[3\]"):
            op(q, k, v, 0, 0.125, 0, sinks[:3])
        with pytest.raises(RuntimeError, match="sinks must be float32 or q's dtype, got Half"):
            op(q, k, v, 0, 0.125, 0, sinks.half())
    with pytest.raises(RuntimeError, match="no decode step bound"):
        op(q, k, v, 0, 0.125)
    released = weakref.ref(caches[0])
    del caches
    assert released() is None
