"""Weight-only quantization: its error on Gaussian weights, agreement of every kernel path
(Folio's kernels, torch's weight-only kernels, dequantize-then-matmul), the exact Q4_1 grid,
int4 groups with float32 scales (Q4_K's), grouped int8 (Q8_0's and Q6_K's grids), and a
quantized tiny model through the loader. Folio's kernels' tests run on their AVX-512 VNNI code
(where the CPU has it) and on their AVX2 code (FOLIO_CPU_ISA=avx2, which they read at every
call), and the two give the same bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.layers.quantization as quantization
from common.config import EngineConfig
from engine.kernels.cpu.capabilities import ISA_ENV, cpu_capabilities
from engine.layers.linear import Linear, pack_weight
from engine.layers.quantization import (
    GROUPED_INT8,
    QuantizedWeight,
    grouped_int8_weight,
    int4_strip_codes,
    int4_weight,
    parts_weight,
    quantize,
)
from engine.models.loader import load_model
from tiny_models import VARIANTS, make_checkpoint

# The default model's linear shapes [out, in] (SmolLM2-135M: hidden 576, 9 heads and 3 KV heads
# of 64, MLP 1536) and its vocabulary projection.
DEFAULT_MODEL_LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
VOCAB_PROJECTION = (49152, 576)
MAX_ERROR = {"int8": 0.01, "int4": 0.10}

needs_folio_kernels = pytest.mark.skipif(
    not cpu_capabilities().folio_kernels,
    reason="this CPU has no AVX2 or no C++ compiler is installed",
)


@pytest.fixture(params=["native", "avx2"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs on the kernels' native code (AVX-512 VNNI where the CPU has it) and on
    their AVX2 code: FOLIO_CPU_ISA, read by the kernels at every call."""
    monkeypatch.setenv(ISA_ENV, request.param)
    return request.param


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


def gaussian(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def q4_1_nibbles(strips: torch.Tensor) -> torch.Tensor:
    """Int4 codes in Folio's strips of 16 output channels ([out / 16, in / 32, 256]) back in
    Q4_1's order ([out, in / 2]), written from the layout's description: byte 64 u + 4 c + i of a
    strip's group holds channel c's code at position 8 u + i in its low half and 8 u + 4 + i in
    its high half."""
    count, groups, _ = strips.shape
    quarters = strips.view(count, groups, 4, 16, 4)  # [strip, group, u, channel, i]
    halves = torch.stack((quarters & 0xF, quarters >> 4), dim=3)  # [.., u, low/high, c, i]
    codes = halves.permute(0, 4, 1, 2, 3, 5).reshape(count * 16, groups, 32)
    return (codes[..., :16] | (codes[..., 16:] << 4)).reshape(count * 16, groups * 16)


def q4_1_form(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Folio-kernel int4 weight as int4_weight takes it: Q4_1-ordered codes, and scales and
    minimums [out, in / 32] (the strips keep them [out / 16, in / 32, 16])."""
    assert weight.minimum is not None

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values.transpose(1, 2).reshape(-1, values.shape[1])

    return q4_1_nibbles(weight.codes), per_row(weight.scale), per_row(weight.minimum)


def as_the_kernels_read(x: torch.Tensor, method: str) -> torch.Tensor:
    """x as Folio's kernels quantize it, mirroring cpu_quant.cpp's float32 steps: each row's whole
    blocks of 32 features as codes round(x * (limit / max|x|)) times max|x| / limit, limit 127
    (int8 codes, against int4 weights) or 32767 (int16, against int8 weights); features past
    the last whole block stay float."""
    limit = 127.0 if method == "int4" else 32767.0
    k32 = x.shape[-1] // 32 * 32
    blocks = x[:, :k32].reshape(x.shape[0], -1, 32)
    max_abs = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(max_abs > 0, limit / max_abs, torch.zeros_like(max_abs))
    codes = torch.round(blocks * inverse)
    return torch.cat(((codes * (max_abs / limit)).view(x.shape[0], k32), x[:, k32:]), dim=-1)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_output_error_on_gaussian_weights(method):
    shapes = DEFAULT_MODEL_LINEARS + ([VOCAB_PROJECTION] if method == "int8" else [])
    for i, (out_features, in_features) in enumerate(shapes):
        weight = gaussian((out_features, in_features), i)
        # Decode-sized and prefill-sized products through the kernels, and the dequantized
        # path of a long prefill.
        for rows in (1, 4, 64, quantization.MAX_FOLIO_KERNEL_ROWS + 1):
            x = gaussian((rows, in_features), 100 + i)
            error = relative_error(pack_weight(weight, method).matmul(x), x @ weight.t())
            print(f"{method} {out_features}x{in_features} rows={rows}: {error:.4%}")
            assert error <= MAX_ERROR[method], (method, out_features, in_features, rows, error)


@needs_folio_kernels
@pytest.mark.parametrize(
    ("method", "in_features", "strips"),
    [
        ("int8", 16, False),
        ("int8", 64, False),
        ("int8", 72, False),
        ("int8", 160, False),
        ("int8", 1064, False),
        ("int8", 64, True),
        ("int8", 1056, True),
        ("int4", 64, None),
        ("int4", 160, None),
        ("int4", 1056, None),
    ],
)
@pytest.mark.usefixtures("isa")
def test_every_kernel_path_computes_the_same_product(method, in_features, strips):
    """Folio's kernel (odd row counts, a row tail, for int8 an input tail not a multiple of
    32 or no whole block, a row of zeros, an outlier; with 1,056+ features, rows in several
    L1-sized chunks; int8 row-major and in strips of 16 output channels) equals the dequantized
    dense product of the same codes with the activations quantized as it quantizes them; torch's
    kernel equals the dense product."""
    weight = gaussian((48, in_features), 1)
    folio = quantize(weight, method, folio_kernels=True, strips=strips)
    if strips is not None:
        assert folio.codes.dim() == (3 if strips else 2)
    torch_only = quantize(weight, method, folio_kernels=False)
    assert folio.kernels is not None and torch_only.kernels is None
    dense = folio.dequantized(torch.float32)
    torch.testing.assert_close(dense, torch_only.dequantized(torch.float32))
    for rows in (1, 2, 3, 5, 16, 37):
        x = gaussian((rows, in_features), rows)
        if rows > 1:
            x[0] = 0
            x[-1, 3] = 100.0
        expected = as_the_kernels_read(x, method) @ dense.t()
        torch.testing.assert_close(folio.matmul(x), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch_only.matmul(x), x @ dense.t(), atol=1e-3, rtol=1e-3)
    # Leading dimensions are kept: [2, 3, in] -> [2, 3, out].
    x = gaussian((2, 3, in_features), 9)
    assert folio.matmul(x).shape == (2, 3, 48)


@needs_folio_kernels
@pytest.mark.usefixtures("isa")
def test_a_row_s_product_does_not_depend_on_the_rows_beside_it():
    """Folio's kernels add each row's products in one order whatever rows share its call (its
    tile of four, a lone decode row, a chunk): a request's greedy tokens do not depend on the
    batch it runs in, and speculative verification rows give what plain decode rows give."""
    codes = torch.randint(-127, 128, (96, 576), dtype=torch.int8, generator=torch.Generator())
    weights = [
        quantize(gaussian((96, 576), 1), "int4", folio_kernels=True),
        quantize(gaussian((96, 72), 2), "int8", folio_kernels=True),
        grouped_int8_weight(codes, (torch.rand(96, 18) * 0.01).half(), strips=True),
        grouped_int8_weight(codes, (torch.rand(96, 18) * 0.01).half(), strips=False),
        quantize(gaussian((96, 576), 4), "int8", folio_kernels=True, strips=True),
    ]
    for weight in weights:
        in_features = weight.shape[1]
        x = gaussian((quantization.MAX_INT4_KERNEL_ROWS, in_features), 3)
        alone = torch.cat([weight.matmul(row[None]) for row in x])
        for rows in (2, 3, 4, 5, 9, 17, len(x)):
            assert torch.equal(weight.matmul(x[:rows]), alone[:rows]), (weight.method, rows)


@needs_folio_kernels
@pytest.mark.usefixtures("isa")
def test_an_output_s_product_does_not_depend_on_the_outputs_beside_it():
    """Against one or two activation rows (a decode step's), Folio's AVX2 int8 kernels take
    four output channels at a time, which share the loads of the activations and the tree that
    sums each product across lanes: every channel's product keeps the order it has alone, so a
    channel gives the same bits whichever channels share its pass (the weight's rows taken from
    every offset, so that the groups of four shift and fewer than four are left at the end; a
    channel alone) and whatever rows share the call. int4 keeps a channel to a lane of its strip
    of 16, and so does grouped int8 where its output channels fill strips: a strip gives the same
    bits beside any others (strips taken from every offset)."""
    int4 = quantize(gaussian((48, 576), 1), "int4", folio_kernels=True)
    weights = [
        (int4, 16),
        (int4_weight(*q4_1_form(int4), torch.float32, True, torch.float32), 16),
        (quantize(gaussian((42, 1544), 2), "int8", folio_kernels=True), 1),  # a float tail of 8
        (grouped_int8_weight(*grouped_codes(42, 576, 32, 3)), 1),
        (grouped_int8_weight(*grouped_codes(42, 1536, 16, 4)), 1),
        (grouped_int8_weight(*grouped_codes(96, 576, 32, 3), strips=True), 16),
        (quantize(gaussian((96, 576), 6), "int8", folio_kernels=True, strips=True), 16),
        (grouped_int8_weight(*grouped_codes(96, 1536, 16, 4), strips=True), 16),
    ]
    for weight, channels in weights:
        x = gaussian((3, weight.shape[1]), 5)
        every = weight.matmul(x)
        for start in (1, 2, 3, 5, 41):
            if start * channels >= weight.shape[0]:
                continue
            part = dataclasses.replace(
                weight,
                codes=weight.codes[start:],
                scale=weight.scale[start:],
                minimum=None if weight.minimum is None else weight.minimum[start:],
            )
            for rows in (1, 2, 3):
                got = part.matmul(x[:rows])
                expected = every[:rows, start * channels :]
                assert torch.equal(got, expected), (weight.method, start, rows)


@needs_folio_kernels
@pytest.mark.parametrize("groups", [5, 16, 37])
def test_int4_codes_permute_losslessly_from_strided_blocks(groups):
    """The permutation into the kernels' strips takes a GGUF tensor's blocks in place (each
    group's 16 code bytes after its scales, rows and groups strided): the same bytes as from
    the codes alone, which the layout's description undoes; a wrong shape, or rows that do not
    fill strips of 16, are refused by name."""
    rows = 48
    file_blocks = torch.randint(0, 256, (rows, groups, 20), dtype=torch.uint8)  # Q4_1: 4 + 16
    in_place = file_blocks[..., 4:]
    q4_1 = in_place.reshape(rows, -1)
    strips = int4_strip_codes(in_place)
    assert strips.shape == (rows // 16, groups, 256)
    assert torch.equal(strips, int4_strip_codes(q4_1))
    assert torch.equal(q4_1_nibbles(strips), q4_1)
    assert not torch.equal(strips.view(rows, -1), q4_1)
    with pytest.raises(RuntimeError, match=r"int4_strip_codes takes uint8 codes"):
        int4_strip_codes(file_blocks)
    with pytest.raises(RuntimeError, match=r"in strips of 16; got 40 rows"):
        int4_strip_codes(in_place[:40])


@needs_folio_kernels
@pytest.mark.parametrize("group_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("groups", [5, 33])
def test_int4_dequantizes_in_one_pass_as_the_dense_path_reads_it(group_dtype, groups):
    """Folio's int4 dequantization kernel gives code * scale + minimum (Q4_1's order) exactly
    in float32, and that rounded to nearest even in bfloat16, from its strips of 16 output
    channels; a long product runs dense in bfloat16 only where the CPU computes it natively,
    within bfloat16's rounding of the float32 one."""
    in_features = 32 * groups
    half = quantize(gaussian((48, in_features), 3), "int4", folio_kernels=True)
    q4_1, half_scale, half_minimum = q4_1_form(half)
    weight = int4_weight(
        q4_1, half_scale.float(), half_minimum.float(), torch.float32, True, group_dtype
    )
    assert weight.minimum is not None
    assert torch.equal(weight.codes, half.codes)
    assert torch.equal(int4_strip_codes(q4_1), half.codes)
    nibbles = q4_1.view(48, groups, 16)
    codes = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1).float()
    _, scale, minimum = q4_1_form(weight)
    exact = torch.addcmul(minimum[..., None], codes, scale[..., None]).view(48, in_features)
    assert torch.equal(weight.dequantized(torch.float32), exact)
    assert torch.equal(weight.dequantized(torch.bfloat16), exact.bfloat16())
    # Other dtypes: the float32 weight, converted.
    assert torch.equal(weight.dequantized(torch.float64), exact.double())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        weight.kernels.int4_dequantize(weight.codes, weight.scale, weight.minimum, torch.float16)
    assert weight.dense_bf16 == cpu_capabilities().native_bf16
    x = gaussian((weight.max_kernel_rows + 1, in_features), 5)
    reference = x.double() @ exact.double().t()
    error = float((weight.matmul(x).double() - reference).norm() / reference.norm())
    assert error <= (1e-2 if weight.dense_bf16 else 1e-6), error


@needs_folio_kernels
@pytest.mark.usefixtures("isa")
def test_int4_groups_with_float32_scales():
    """Group scales and minimums that float16 cannot hold (Q4_K's d * sc, a float16 times a
    6-bit integer) kept in float32: the same values as float16 or float32 give the same product
    bit for bit; 17-bit scales dequantize to code * scale + minimum exactly, and the kernel's
    product is the dense one with the activations quantized as it quantizes them."""
    half = quantize(gaussian((48, 160), 2), "int4", folio_kernels=True)
    assert half.scale.dtype == torch.float16
    q4_1, half_scale, half_minimum = q4_1_form(half)

    def wide(scale: torch.Tensor, minimum: torch.Tensor) -> QuantizedWeight:
        weight = int4_weight(q4_1, scale, minimum, torch.float32, True, torch.float32)
        assert weight.scale.dtype == weight.minimum.dtype == torch.float32
        return weight

    same = wide(half_scale.float(), half_minimum.float())
    g = torch.Generator().manual_seed(4)
    d = (torch.rand(48, 5, generator=g) * 1e-3 + 1e-4).half().float()
    scale = d * torch.randint(33, 64, (48, 5), generator=g)
    minimum = -(d * torch.randint(0, 64, (48, 5), generator=g))
    assert (scale.half().float() != scale).any()  # float16 would round these
    exact = wide(scale, minimum)
    nibbles = q4_1.view(48, 5, 16)
    codes = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1).float()
    dense = (codes * scale[..., None] + minimum[..., None]).view(48, 160)
    assert torch.equal(exact.dequantized(torch.float32), dense)
    for rows in (1, 5, 37):
        x = gaussian((rows, 160), rows)
        assert torch.equal(same.matmul(x), half.matmul(x))
        expected = as_the_kernels_read(x, "int4") @ dense.t()
        torch.testing.assert_close(exact.matmul(x), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="both float16 or both float32"):
        torch.ops.folio_quant.int4_linear(x, half.codes, half.scale, exact.minimum)
    with pytest.raises(ValueError, match="int4 group scales are float16 or float32"):
        int4_weight(q4_1, scale, minimum, torch.float32, True, torch.bfloat16)


def grouped_codes(out_features: int, in_features: int, group: int, seed: int):
    """Random codes and scales on a Q8_0 grid (groups of 32: int8 codes, -128 too, which Q8_0
    never writes but the kernel takes, float16 d) or a Q6_K one (groups of 16: codes -32 to 31,
    float32 scales d * sc, a float16 times an int8, which float16 would round)."""
    g = torch.Generator().manual_seed(seed)
    low, high = (-128, 128) if group == 32 else (-32, 32)
    codes = torch.randint(low, high, (out_features, in_features), generator=g, dtype=torch.int8)
    groups = (out_features, in_features // group)
    d = (torch.rand(groups, generator=g) * 1e-2 + 1e-4).half()
    if group == 32:
        return codes, d
    return codes, d.float() * torch.randint(-128, 128, groups, generator=g).float()


def int16_rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernels' int16 activations may add to x @ weight.T at most: each feature off by
    at most half a step, max|x| / 65534 over its block of 32, times |w| summed; plus float32's
    summation (1e-5 of sum |x| |w|, far above what its rounding reaches here)."""
    block_max = x.abs().unflatten(-1, (-1, 32)).amax(dim=-1, keepdim=True)
    steps = block_max.expand(*block_max.shape[:-1], 32).flatten(-2)
    return (steps.double() @ weight.abs().t()) / 65534 + 1e-5 * (
        x.abs().double() @ weight.abs().t()
    )


@needs_folio_kernels
@pytest.mark.parametrize(("group", "in_features"), [(32, 64), (32, 576), (16, 64), (16, 1056)])
@pytest.mark.parametrize("strips", [True, False])
@pytest.mark.usefixtures("isa")
def test_grouped_int8_kernel_computes_the_dense_product(group, in_features, strips):
    """Folio's grouped int8 kernel (Q8_0's groups of 32 with float16 scales, Q6_K's groups of
    16 with float32 ones): its weights are code * scale exactly; its product (decode-sized and
    prefill-sized, odd row counts, a row of zeros, an outlier, rows in several L1-sized chunks)
    is the dense product of those weights with the activations quantized as it quantizes them
    (int16 per 32 features), and the float64 one within that rounding's bound; the same scales
    as float16 or float32 give the same product bit for bit; looked-up rows are the weight's.
    Both layouts: strips of 16 output channels and row-major."""
    n = 48
    codes, scale = grouped_codes(n, in_features, group, seed=group + in_features)
    weight = grouped_int8_weight(codes, scale, strips)
    assert weight.method == GROUPED_INT8 and weight.scale.dtype == scale.dtype
    assert weight.codes.dim() == (3 if strips else 2) and weight.shape == (n, in_features)
    exact = (codes.double().view(n, -1, group) * scale.double()[..., None]).view(n, -1)
    dense = weight.dequantized(torch.float32)
    assert torch.equal(dense.double(), exact)  # code * scale: exact in float32
    wide = grouped_int8_weight(codes, scale.float(), strips)
    worst = 0.0
    for rows in (1, 2, 3, 4, 5, 16, 37, 300):
        x = gaussian((rows, in_features), rows)
        if rows > 1:
            x[0] = 0
            x[-1, 3] = 100.0
        got = weight.matmul(x)
        if rows <= quantization.MAX_FOLIO_KERNEL_ROWS:
            # The same products, summed in another order (float32: 1e-5 of sum |x| |w|).
            expected = as_the_kernels_read(x, "int8") @ dense.t()
            assert ((got - expected).abs() <= 1e-5 * (x.abs() @ dense.abs().t())).all(), rows
        assert torch.equal(wide.matmul(x), got)
        reference = x.double() @ exact.t()
        assert ((got - reference).abs() <= int16_rounding_bound(x, exact)).all(), rows
        worst = max(worst, float((got - reference).norm() / reference.norm()))
    print(f"grouped int8, groups of {group}, {in_features} features: {worst:.1e}")
    x = gaussian((2, 3, in_features), 9)  # leading dimensions are kept
    assert weight.matmul(x).shape == (2, 3, n)
    ids = torch.tensor([[0, n - 1, 5], [5, 5, 17]])
    assert torch.equal(weight.rows(ids), dense[ids])


@needs_folio_kernels
@pytest.mark.parametrize(("out_features", "strips"), [(48, True), (40, None)])
def test_compiled_lookups_keep_a_row_s_bits_beside_other_rows(out_features, strips):
    """Embeddings looked up in a grouped int8 weight (strips, or row-major), then an RMSNorm, as
    a compiled decode program runs them: a row alone (the one-row program) and beside others
    (a verification step's) gives the same bits. A gather traced into the norm's reduction was
    vectorized otherwise at one row than at several (the default model's greedy tokens then
    differed with speculation); the lookup is one opaque op."""
    weight = grouped_int8_weight(*grouped_codes(out_features, 576, 32, seed=7), strips)
    assert weight.codes.dim() == (3 if strips else 2)
    norm = gaussian((576,), 8)

    def embed_and_norm(ids: torch.Tensor) -> torch.Tensor:
        x = weight.rows(ids)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm

    compiled = torch.compile(embed_and_norm, dynamic=True)
    ids = torch.tensor([3, out_features - 1, 17, 0, 21])
    together = compiled(ids)
    for i in range(len(ids)):
        assert torch.equal(compiled(ids[i : i + 1])[0], together[i]), i
    with pytest.raises(RuntimeError, match=f"id {out_features} outside \\[0, {out_features}\\)"):
        weight.rows(torch.tensor([out_features]))


@needs_folio_kernels
def test_bad_grouped_int8_weights_are_refused_naming_the_problem():
    codes, scale = grouped_codes(8, 64, 32, seed=1)
    with pytest.raises(ValueError, match=r"an int8 matrix, got torch\.uint8"):
        grouped_int8_weight(codes.view(torch.uint8), scale)
    with pytest.raises(ValueError, match=r"float16 or float32, not torch\.bfloat16"):
        grouped_int8_weight(codes, scale.bfloat16())
    with pytest.raises(ValueError, match="divisible by 32; a weight has 48"):
        grouped_int8_weight(codes[:, :48], scale[:, :1])
    with pytest.raises(ValueError, match=r"one per 32 or 16 features, \[8, 2 or 4\]; got \(8, 3\)"):
        grouped_int8_weight(codes, torch.ones(8, 3))
    with pytest.raises(ValueError, match="rows are looked up in grouped int8 weights, not int8"):
        quantize(torch.ones(8, 64), "int8", folio_kernels=True).rows(torch.tensor([0]))
    op = torch.ops.folio_quant.grouped_int8_linear
    x = torch.ones(2, 64)
    with pytest.raises(RuntimeError, match="x has 63 columns, the weight 64"):
        op(x[:, :63].contiguous(), codes, scale)
    with pytest.raises(RuntimeError, match=r"int8 weights \[N, K\] and float16 or float32"):
        op(x, codes, scale.bfloat16())
    with pytest.raises(RuntimeError, match="a scale per 32 or per 16 input features: 3 groups"):
        op(x, codes, torch.ones(8, 3))
    with pytest.raises(RuntimeError, match="divisible by 32, got 48"):
        op(x[:, :48].contiguous(), codes[:, :48].contiguous(), scale[:, :1].contiguous())
    strips = grouped_int8_weight(*grouped_codes(16, 64, 32, seed=2), strips=True)
    assert strips.codes.shape == (1, 2, 512)
    with pytest.raises(ValueError, match="need output features divisible by 16; a weight has 8"):
        grouped_int8_weight(codes, scale, strips=True)
    with pytest.raises(RuntimeError, match=r"strips are .* \[N / 16, K / 32, 512\] with scales"):
        op(x, strips.codes, strips.scale.view(1, 16, 2))
    with pytest.raises(RuntimeError, match="x has 63 columns, the weight 64"):
        op(x[:, :63].contiguous(), strips.codes, strips.scale)
    int8 = quantize(torch.ones(16, 64), "int8", folio_kernels=True, strips=True)
    with pytest.raises(RuntimeError, match=r"int8 strips are .* float32 scales \[N / 16, 16\]"):
        torch.ops.folio_quant.int8_linear(x, int8.codes, int8.scale.view(-1))


def test_int4_reproduces_a_q4_1_grid_exactly():
    """Weights already on a Q4_1 grid (each group: min + code * scale, codes 0..15 with both
    ends present, scale and min float16 values, as a Q4_1 GGUF dequantizes) come back
    unchanged."""
    out_features, in_features = 32, 128
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(out_features, in_features // 32, 1, generator=g) * 0.02 + 0.001).half()
    minimum = (-torch.rand(out_features, in_features // 32, 1, generator=g) * 0.1).half()
    scale, minimum = scale.float(), minimum.float()
    weight = (minimum + codes * scale).view(out_features, in_features)
    torch.testing.assert_close(
        pack_weight(weight, "int4").dequantized(torch.float32), weight, atol=1e-6, rtol=0
    )


def test_unquantizable_weights_are_refused():
    with pytest.raises(ValueError, match="divisible by 32; a weight has 72"):
        pack_weight(torch.zeros(8, 72), "int4")
    for folio_kernels in (False, True):
        with pytest.raises(ValueError, match="divisible by 16; a weight has 40"):
            quantize(torch.zeros(40, 64), "int4", folio_kernels=folio_kernels)
    with pytest.raises(ValueError, match="int8 strips need output features divisible by 16 "):
        quantize(torch.zeros(40, 64), "int8", folio_kernels=True, strips=True)
    with pytest.raises(ValueError, match=r"one of .*int3"):
        pack_weight(torch.zeros(8, 64), "int3")
    with pytest.raises(ValueError, match=r"quantization must be one of .*got 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization runs on the CPU only, got device 'cuda'"):
        EngineConfig(quantization="int8", device="cuda")


@pytest.mark.parametrize(("method", "max_error"), [("int8", 0.05), ("int4", 0.35)])
def test_a_quantized_tiny_model_tracks_the_float_one(tmp_path, method, max_error):
    from test_models import Runner, random_tokens

    make_checkpoint(tmp_path, *VARIANTS["qwen2-bias-tied"])  # biases on q/k/v
    exact_model, config = load_model(tmp_path, torch.float32, "cpu")
    model, _ = load_model(tmp_path, torch.float32, "cpu", quantization=method)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, QuantizedWeight) for m in linears)
    assert all(m.weight.numel() == 0 for m in linears)  # only the quantized copy is kept
    assert isinstance(model.lm_head_packed, QuantizedWeight)
    assert model.lm_head_packed.method == "int8"
    prompt = random_tokens(12, 5)
    (exact,) = Runner(exact_model, config).step([("a", prompt)])
    (approx,) = Runner(model, config).step([("a", prompt)])  # 12 rows: the kernels' path
    error = relative_error(approx, exact)
    print(f"{method}: logits relative error {error:.3%}")
    assert 0 < error <= max_error


def test_auto_dtype_of_a_quantized_cpu_model_takes_the_kernels_input():
    """ "auto" follows the hardware (bfloat16 only where the CPU computes it natively), except
    for a quantized model where Folio's integer kernels load: float32, which they take."""
    from engine.model_runner import resolve_dtype

    native_bf16 = cpu_capabilities().native_bf16  # False under FOLIO_CPU_ISA=avx2
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native_bf16 else torch.float32)
    expected = torch.float32 if cpu_capabilities().folio_kernels else resolve_dtype("auto", "cpu")
    for method in ("int8", "int4"):
        assert resolve_dtype("auto", "cpu", method) == expected
        assert resolve_dtype("bfloat16", "cpu", method) == torch.bfloat16


@needs_folio_kernels
def test_the_avx512_code_gives_the_avx2_code_s_bits(monkeypatch):
    """Every kernel (int4 with float16 and float32 group scales, int8, grouped int8 in groups of
    32 and 16, row-major and in strips, a parts layer mixing int4 and grouped int8) on every
    layout of the activations' units (1 to 18 blocks: whole units of four int4 groups or two
    int8 blocks, and a pair and a single block left over; int4's whole blocks of 16 groups, one
    to three, and 1 or 2 groups after them), row counts in tiles of eight and four and their
    remainders and rows in several L1-sized chunks: the AVX-512 code's outputs are the AVX2
    code's, bit for bit (on a CPU without AVX-512 VNNI both are the AVX2 code)."""
    weights = []
    for blocks in (1, 2, 3, 4, 5, 6, 7, 16, 18, 49):
        in_features = 32 * blocks
        int4 = quantize(gaussian((48, in_features), blocks), "int4", folio_kernels=True)
        q4_1, scale, minimum = q4_1_form(int4)
        float32_int4 = int4_weight(
            q4_1, scale.float() * 1.0001, minimum.float(), torch.float32, True, torch.float32
        )
        q8_0 = grouped_int8_weight(*grouped_codes(40, in_features, 32, blocks))
        q6_k = grouped_int8_weight(*grouped_codes(24, in_features, 16, blocks))
        weights += [int4, float32_int4, q8_0, q6_k, parts_weight([int4, q6_k, q8_0])]
        # Output channels that fill strips of 16: grouped int8 in strips.
        q8_0 = grouped_int8_weight(*grouped_codes(48, in_features, 32, blocks), strips=True)
        q6_k = grouped_int8_weight(*grouped_codes(32, in_features, 16, blocks), strips=True)
        weights += [q8_0, q6_k, parts_weight([int4, q6_k, q8_0])]
        weights.append(quantize(gaussian((48, in_features), blocks), "int8", True, strips=True))
        int8 = quantize(gaussian((40, in_features + 8), blocks), "int8", folio_kernels=True)
        weights.append(int8)  # whole blocks and a float tail of 8 features
    for weight in weights:
        in_features = weight.shape[1]
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 19, 37):
            x = gaussian((rows, in_features), rows)
            monkeypatch.setenv(ISA_ENV, "avx2")
            avx2 = weight.matmul(x)
            monkeypatch.setenv(ISA_ENV, "native")
            assert torch.equal(weight.matmul(x), avx2), (weight.method, in_features, rows)
