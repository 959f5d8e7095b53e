"""The AVX2 paths on any CPU with AVX2 (forced where the CPU has more): widened_bf16_linear gives
the float32 product of the widened bfloat16 weights, pack_weight stores a float32 weight in
bfloat16 only where that keeps its values and the CPU has no bf16 tiles, and FOLIO_CPU_ISA=avx2
makes the one capability probe answer as on an AVX2-only CPU (dtype "auto" float32, grouped int8
row-major)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from engine.kernels.cpu import capabilities
from engine.kernels.cpu.capabilities import ISA_ENV, cpu_capabilities
from engine.layers.linear import Bf16Tiles, pack_weight
from engine.layers.quantization import grouped_int8_weight
from engine.model_runner import resolve_dtype

needs_kernels = pytest.mark.skipif(
    not cpu_capabilities().folio_kernels, reason="this CPU has no AVX2 or no C++ compiler"
)


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """The probe answers again after the test changes its environment, and again after it."""
    cpu_capabilities.cache_clear()
    yield
    cpu_capabilities.cache_clear()


def float32_sum_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far two float32 summation orders of x @ weight.T can lie apart: a float32 unit of
    the sum of the terms' magnitudes per term."""
    magnitude = x.double().abs() @ weight.double().abs().t()
    return magnitude * weight.shape[1] * 2**-23 + 1e-30


@needs_kernels
def test_widened_bf16_linear_is_the_float32_product_of_the_widened_weights():
    """Shapes off the tiles (outputs not a multiple of 16, 1 to 19 rows: every row block and
    tile tail), a bias, strided activation rows, a batched input; and a model-sized one."""
    generator = torch.Generator().manual_seed(0)
    for out, inp, row_counts in ((40, 18, (1, 2, 3, 4, 5, 8, 9, 16, 19)), (70, 576, (1, 16))):
        weight = torch.randn(out, inp, generator=generator).bfloat16()
        bias = torch.randn(out, generator=generator)
        tiles = pack_weight(weight.float(), None, avx2_capabilities())
        assert isinstance(tiles, Bf16Tiles) and tiles.widened
        assert tiles.tiles.dtype == torch.bfloat16  # half float32's bytes
        for rows in row_counts:
            x = torch.randn(rows, inp + 12, generator=generator)[:, 5 : 5 + inp]  # strided rows
            got = tiles.matmul(x, bias)
            assert got.dtype == torch.float32 and got.shape == (rows, out)
            # torch's float32 product of the widened weights, and the exact one: apart by
            # float32 summation order at most.
            bound = float32_sum_bound(x, weight.float())
            torchs = torch.nn.functional.linear(x, weight.float(), bias)
            assert ((got - torchs).double().abs() <= 2 * bound).all()
            exact = x.double() @ weight.double().t() + bias.double()
            assert ((got.double() - exact).abs() <= bound).all()
        batched = tiles.matmul(x.reshape(1, rows, inp))
        assert batched.shape == (1, rows, out)
        assert torch.equal(batched[0], tiles.matmul(x))
    with pytest.raises(RuntimeError, match="activations have 17 features, the weight 576"):
        tiles.matmul(torch.zeros(1, 17))
    with pytest.raises(RuntimeError, match="float32 activations"):
        tiles.matmul(torch.zeros(1, 576).bfloat16())


def avx2_capabilities() -> capabilities.CpuCapabilities:
    """This CPU's capabilities as an AVX2-only one has them."""
    return dataclasses.replace(cpu_capabilities(), avx512_bf16=False, native_bf16=False)


@needs_kernels
def test_float32_weights_are_stored_in_bf16_only_where_that_keeps_their_values():
    bf16_values = torch.randn(32, 64).bfloat16().float()
    avx2 = avx2_capabilities()
    assert avx2.widened_bf16 and not avx2.bf16_tiles
    packed = pack_weight(bf16_values, None, avx2)
    assert isinstance(packed, Bf16Tiles) and packed.widened
    # One value off bfloat16's grid: float32 stays (oneDNN's layout, or torch's F.linear).
    off_grid = bf16_values.clone()
    off_grid[3, 5] += 2**-20
    assert not isinstance(pack_weight(off_grid, None, avx2), Bf16Tiles)
    # With AVX-512 BF16 a float32 model keeps oneDNN's float32 kernels.
    avx512 = dataclasses.replace(avx2, avx512_bf16=True, native_bf16=True)
    assert not isinstance(pack_weight(bf16_values, None, avx512), Bf16Tiles)


@pytest.mark.usefixtures("fresh_probe")
def test_forcing_avx2_makes_the_probe_answer_as_on_an_avx2_only_cpu(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "avx2")
    forced = cpu_capabilities()
    assert not forced.avx512_bf16 and not forced.native_bf16 and not forced.bf16_tiles
    assert not forced.avx512_vnni
    assert forced.widened_bf16 == forced.folio_kernels
    assert resolve_dtype("auto", "cpu") == torch.float32
    if forced.folio_kernels:  # grouped int8 row-major, as on an AVX2-only CPU
        codes, scale = torch.ones(32, 64, dtype=torch.int8), torch.ones(32, 2).half()
        assert grouped_int8_weight(codes, scale).codes.shape == (32, 64)
        monkeypatch.setenv(ISA_ENV, "native")
        cpu_capabilities.cache_clear()
        strips = cpu_capabilities().avx512_vnni  # strips of 16 channels where VNNI is native
        assert grouped_int8_weight(codes, scale).codes.dim() == (3 if strips else 2)
    monkeypatch.setenv(ISA_ENV, "avx512")
    cpu_capabilities.cache_clear()
    with pytest.raises(ValueError, match=f"{ISA_ENV} must be one of native, avx2, got 'avx512'"):
        cpu_capabilities()
