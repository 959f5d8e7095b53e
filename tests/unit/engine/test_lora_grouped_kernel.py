"""Folio's grouped LoRA kernel (engine/kernels/cpu/cpu_lora.cpp, folio_lora::lora_add) and its
fallback in torch's ops (folio::lora_add) against a float64 reference built from the adapters'
own A and B: random slots with base-model rows (-1) and an unused slot, a fused three-shard
layer whose shards and input are no multiple of the vector width, ranks below the slots'
width padded with zeros, float32, bfloat16 and float16, the AVX-512 code (bfloat16's shrink in
vdpbf16ps where the CPU has AVX-512 BF16, and widened) and the AVX2 code; each row's result the
same whatever rows share its call; bad inputs refused naming the problem; and a wrapped linear
traced whole (no graph break) with the kernel in the graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.layers.linear import Linear
from engine.layers.lora import (
    ISA_AVX2,
    ISA_AVX512,
    ISA_AVX512_BF16,
    TILE,
    LoraGroups,
    LoraLinear,
    b_tiles,
    fill_groups,
    torch_lora_add,
)
from engine.lora.adapter import ModuleShape

needs_kernels = pytest.mark.skipif(
    not cpu_capabilities().folio_kernels, reason="this CPU has no AVX2 or no C++ compiler"
)

# Shard 0's 40 columns: a whole tile of TILE (two vectors of columns a step, bfloat16's even
# and odd ones on AVX-512) and 8 more (one AVX2 vector); shards 1 and 2: tails.
IN, SHARDS, SLOTS, RANK = 67, (40, 9, 9), 5, 4
# Slot 4 is unused; slot 1 has rank 2, slot 3 rank 3 with no second shard.
RANKS = {0: 4, 1: 2, 2: 4, 3: 3}
# How far a result may lie from the exact one: float32 sums (per term magnitude), then one
# rounding to the output's dtype (half a unit, taken as a whole one).
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def adapters(seed: int) -> dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per slot, per shard, (A [rank, IN], B [shard rows, rank]) in float64."""
    generator = torch.Generator().manual_seed(seed)
    weights: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for slot, rank in RANKS.items():
        weights[slot] = {
            shard: (
                torch.randn(rank, IN, generator=generator, dtype=torch.float64) * 0.3,
                torch.randn(rows, rank, generator=generator, dtype=torch.float64) * 0.3,
            )
            for shard, rows in enumerate(SHARDS)
            if (slot, shard) != (3, 1)
        }
    return weights


def stacked(weights, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots as the kernel takes them: A [slots, shards * RANK, IN], B in tiles [slots,
    tiles, RANK, TILE], ranks padded with zeros."""
    a = torch.zeros(SLOTS, len(SHARDS) * RANK, IN, dtype=dtype)
    tiles = np.cumsum((0, *(-(-rows // TILE) for rows in SHARDS))).tolist()
    b = torch.zeros(SLOTS, tiles[-1], RANK, TILE, dtype=dtype)
    for slot, shards in weights.items():
        for shard, (a_k, b_k) in shards.items():
            rank = a_k.shape[0]
            a[slot, shard * RANK : shard * RANK + rank] = a_k.to(dtype)
            b[slot, tiles[shard] : tiles[shard + 1], :rank] = b_tiles(b_k.to(dtype))
    return a, b


def reference(weights, y, x, slots, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result from the adapters' weights as stored in `dtype` (float64), and how far
    the kernel's may lie from it."""
    exact, magnitude = y.double().clone(), y.double().abs()
    bounds = np.cumsum((0, *SHARDS)).tolist()
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for shard, (a_k, b_k) in weights[slot].items():
            a_k, b_k = a_k.to(dtype).double(), b_k.to(dtype).double()
            columns = slice(bounds[shard], bounds[shard + 1])
            x_row = x[row].double()
            exact[row, columns] += b_k @ (a_k @ x_row)
            magnitude[row, columns] += b_k.abs() @ (a_k.abs() @ x_row.abs())
    terms = IN + RANK + 2
    bound = magnitude * terms * 2.0**-23 + exact.abs() * ROUNDING[dtype] + 1e-30
    return exact, bound


def inputs(rows: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    # Strided activation rows, as a view of a wider tensor.
    x = torch.randn(rows, IN + 5, generator=generator)[:, 2 : 2 + IN].to(dtype)
    y = torch.randn(rows, sum(SHARDS), generator=generator).to(dtype)
    slots = torch.randint(-1, SLOTS - 1, (rows,), generator=generator, dtype=torch.int32)
    return y, x, slots


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "isa", [ISA_AVX512_BF16, ISA_AVX512, ISA_AVX2], ids=["avx512_bf16", "avx512", "avx2"]
)
def test_kernel_equals_the_reference_and_each_row_its_own_alone(dtype, isa):
    weights = adapters(seed=1)
    a, b = stacked(weights, dtype)
    for rows in (1, 3, 23, 70):
        y, x, slots = inputs(rows, dtype, seed=rows)
        y_before = y.clone()
        got = torch.ops.folio_lora.lora_add(y, x, slots, a, b, list(SHARDS), isa)
        assert got.dtype == dtype and got.shape == y.shape
        assert torch.equal(y, y_before)  # its inputs stay as they were
        exact, bound = reference(weights, y, x, slots, dtype)
        assert ((got.double() - exact).abs() <= bound).all()
        base = slots < 0
        assert torch.equal(got[base], y[base])  # the base model's rows: y's values
        for row in range(rows):
            alone = torch.ops.folio_lora.lora_add(
                y[row : row + 1], x[row : row + 1], slots[row : row + 1], a, b, list(SHARDS), isa
            )
            assert torch.equal(alone[0], got[row])


@needs_kernels
def test_avx512_and_avx2_code_agree_in_float32():
    """Where the CPU has AVX-512, both codes run here: one float32 result up to summation
    order (the AVX2 one is what an AVX2-only CPU runs)."""
    weights = adapters(seed=2)
    a, b = stacked(weights, torch.float32)
    y, x, slots = inputs(40, torch.float32, seed=3)
    wide = torch.ops.folio_lora.lora_add(y, x, slots, a, b, list(SHARDS), ISA_AVX512)
    narrow = torch.ops.folio_lora.lora_add(y, x, slots, a, b, list(SHARDS), ISA_AVX2)
    _, bound = reference(weights, y, x, slots, torch.float32)
    assert ((wide.double() - narrow.double()).abs() <= 2 * bound).all()


@needs_kernels
@pytest.mark.skipif(not cpu_capabilities().avx512_bf16, reason="this CPU has no AVX-512 BF16")
def test_bfloat16_shrink_runs_in_pairs_where_the_cpu_has_avx512_bf16():
    """bfloat16 on AVX-512 BF16 takes its own code, float32 and the lower levels do not: a row
    of A whose products cancel, 2^25 + 1 - 2^25. The widened code sums values 0 and 16 in one
    lane and value 1 in another: 1. vdpbf16ps adds the pair of values 0 and 1 in one lane,
    2^25 + 1 rounded to 2^25 in float32, then value 16 in another: 0."""
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.zeros(1, 1, 32, dtype=dtype)
        a[0, 0, :2] = torch.tensor([2.0**25, 1.0])
        a[0, 0, 16] = -(2.0**25)
        b = torch.zeros(1, 1, 1, TILE, dtype=dtype)
        b[0, 0, 0, 0] = 1.0
        x, y = torch.ones(1, 32, dtype=dtype), torch.zeros(1, 1, dtype=dtype)
        slots = torch.zeros(1, dtype=torch.int32)
        for isa in (ISA_AVX512_BF16, ISA_AVX512, ISA_AVX2):
            got = torch.ops.folio_lora.lora_add(y, x, slots, a, b, [1], isa)
            pairs = dtype == torch.bfloat16 and isa == ISA_AVX512_BF16
            assert got.item() == (0.0 if pairs else 1.0), (dtype, isa)


def test_torch_fallback_equals_the_reference():
    weights = adapters(seed=4)
    a, b = stacked(weights, torch.float32)
    y, x, slots = inputs(23, torch.float32, seed=5)
    got = torch_lora_add(y, x, slots, a, b, list(SHARDS))
    exact, bound = reference(weights, y, x, slots, torch.float32)
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(got[slots < 0], y[slots < 0])


@needs_kernels
def test_bad_inputs_are_refused_naming_the_problem():
    a, b = stacked(adapters(seed=6), torch.float32)
    y, x, slots = inputs(4, torch.float32, seed=7)
    op = torch.ops.folio_lora.lora_add
    cases = [
        (
            (y, x, torch.tensor([0, 5, -1, 1], dtype=torch.int32), a, b, list(SHARDS)),
            "row 1 has slot 5, outside -1 .. 4",
        ),
        ((y, x, slots.long(), a, b, list(SHARDS)), "slots must be int32 with one per row"),
        ((y, x, slots[:3], a, b, list(SHARDS)), "slots must be int32 with one per row"),
        ((y, x.double(), slots, a, b, list(SHARDS)), "must share one dtype"),
        ((y, x, slots, a, b, [40, 9, 8]), "the shards' outputs add up to 57"),
        ((y, x, slots, a, b, [40, 18]), "B has 4 tiles, the shards take 3 of 32 outputs"),
        (
            (y, x, slots, a[:, :8].contiguous(), b, list(SHARDS)),
            "A has 8 rows for 3 shards of rank 4",
        ),
        ((y, x[:, :60], slots, a, b, list(SHARDS)), "activations have 60 features, A takes 67"),
        ((y, x, slots, a.transpose(1, 2), b, list(SHARDS)), "must be contiguous"),
    ]
    with pytest.raises(RuntimeError, match="isa 3 is none of 0"):
        op(y, x, slots, a, b, list(SHARDS), 3)
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(*args, ISA_AVX512_BF16)


def test_wrapped_linear_is_traced_whole_with_its_product_in_the_graph():
    """A LoRA linear traced with fullgraph (as compiled decode programs are): the grouped op
    (Folio's kernel, or torch's where it did not load) is one node of the graph, and the
    traced layer gives the eager one's output, reading the step's slots as they are when it
    runs."""
    shape = ModuleShape(IN, SHARDS)
    cpu = torch.device("cpu")
    base = Linear(IN, list(SHARDS), False, torch.float32, "cpu")
    base.weight.data.normal_(0, 0.2)
    step = LoraGroups.sized(16, cpu)
    layer = LoraLinear(base, shape, SLOTS, RANK, torch.float32, cpu, step)
    for slot, shards in adapters(seed=8).items():
        layer.load(slot, {k: (a.float(), b.float()) for k, (a, b) in shards.items()})
    _, x, slots = inputs(6, torch.float32, seed=9)
    fill_groups(step, slots.numpy().astype(np.int64), cpu, kernels=False)
    called: list[object] = []

    def backend(graph_module: torch.fx.GraphModule, example_inputs):
        called.extend(node.target for node in graph_module.graph.nodes)
        return graph_module.forward

    torch._dynamo.reset()
    traced = torch.compile(layer, backend=backend, fullgraph=True)
    with torch.no_grad():
        eager = layer(x)
        assert torch.equal(traced(x), eager)
        op = torch.ops.folio_lora.lora_add if layer.folio_kernel else torch.ops.folio.lora_add
        assert op in called or op.default in called
        # Other slots for the same rows, written in place: the traced layer reads them.
        fill_groups(step, np.roll(slots.numpy(), 1).astype(np.int64), cpu, kernels=False)
        assert torch.equal(traced(x), layer(x))
        assert not torch.equal(layer(x), eager)
