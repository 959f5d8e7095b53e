"""The segmented LoRA kernels (shrink into the narrow intermediate, expand added into the base
output) against the plain loop over segments, under the Triton interpreter (or natively with
FOLIO_KERNEL_DEVICE=cuda): uneven segments, rows of the base model in none, a slot unused,
widths and outputs that are no power of two (masked tiles); and engine.layers.lora's wrapped
linear gives the same output through the kernels as through its CPU path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn

from engine.kernels.triton.lora import lora_expand, lora_ref, lora_shrink
from engine.layers.linear import Linear
from engine.layers.lora import LoraGroups, LoraLinear, fill_groups
from engine.lora.adapter import ModuleShape

IN, WIDTH, OUT, SLOTS = 40, 24, 56, 4
MIXED = [0, -1, 3, 0, 0, 3, -1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]


def kernel_groups(slots: list[int]) -> LoraGroups:
    step = LoraGroups.sized(len(slots), SLOTS, torch.float32, torch.device(DEVICE))
    fill_groups(step, np.array(slots), torch.device(DEVICE), kernels=True)
    return step


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slots", [[2], MIXED, [-1, 1, -1]], ids=["one-row", "mixed", "base"])
def test_shrink_then_expand_matches_the_loop(dtype, slots):
    num_rows = len(slots)
    x = randn(num_rows, IN, dtype=dtype, seed=1)
    a = randn(SLOTS, WIDTH, IN, dtype=dtype, seed=2, scale=0.3)
    b = randn(SLOTS, OUT, WIDTH, dtype=dtype, seed=3, scale=0.3)
    base = randn(num_rows, OUT, dtype=dtype, seed=4)
    step = kernel_groups(slots)
    assert step.sorted_rows is not None and step.segments is not None
    out = base.clone()
    shrunk = lora_shrink(x, a, step.sorted_rows, step.segments)
    lora_expand(shrunk, b, step.sorted_rows, step.segments, out)
    expected = lora_ref(x, a, b, step.sorted_rows, step.segments, base)
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base_rows], base[base_rows])  # the base model's rows: untouched
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # The interpreter rounds float32 to bfloat16 towards zero (see test_fused_moe).
        bound = 0.03 * expected.abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), atol=bound, rtol=0.03)
    else:
        assert_close(out, expected, dtype)


def test_wrapped_linear_gives_the_same_through_kernels_and_cpu_paths():
    """A fused three-shard linear with ranks 3 and 2 in a slot of width 4 per shard: the same
    output through the kernels, the CPU's per-slot loop and its product of every slot at once
    (the mask); then a slot loaded again in place changes the dense product's rows of that
    slot only."""
    shape = ModuleShape(IN, (24, 16, 16))
    base = Linear(IN, list(shape.shard_rows), False, torch.float32, DEVICE)
    base.weight.data.copy_(randn(56, IN, dtype=torch.float32, seed=5, scale=0.2))
    step = LoraGroups.sized(len(MIXED), SLOTS, torch.float32, torch.device(DEVICE))
    layer = LoraLinear(base, shape, SLOTS, 4, torch.float32, torch.device(DEVICE), step)
    for slot, rank in ((0, 3), (2, 2), (3, 4)):
        shards = {
            s: (
                randn(rank, IN, dtype=torch.float32, seed=10 * slot + s, scale=0.3),
                randn(shape.shard_rows[s], rank, dtype=torch.float32, seed=99 - s, scale=0.3),
            )
            for s in range(3)
            if (slot, s) != (2, 1)  # slot 2 leaves its second shard out
        }
        layer.load(slot, shards)
    x = randn(len(MIXED), IN, dtype=torch.float32, seed=6)
    fill_groups(step, np.array(MIXED), torch.device(DEVICE), kernels=False, dense=False)
    assert not step.dense and step.groups
    cpu_path = layer(x)
    assert_rows_add_their_slots(layer, base, x, cpu_path)
    fill_groups(step, np.array(MIXED), torch.device(DEVICE), kernels=False)
    assert step.dense and not step.groups
    dense = layer(x)
    assert_close(dense, cpu_path, torch.float32)
    fill_groups(step, np.array(MIXED), torch.device(DEVICE), kernels=True)
    assert_close(layer(x), cpu_path, torch.float32)
    # Slot 3 again, other weights, in place: the dense product's rows of slot 3 change, the
    # others stay (each slot's columns of the stacked forms are its own).
    a = randn(4, IN, dtype=torch.float32, seed=7, scale=0.3)
    layer.load(3, {0: (a, randn(24, 4, dtype=torch.float32, seed=8, scale=0.3))})
    fill_groups(step, np.array(MIXED), torch.device(DEVICE), kernels=False)
    reloaded = layer(x)
    assert_rows_add_their_slots(layer, base, x, reloaded)
    for row, slot in enumerate(MIXED):
        assert torch.equal(reloaded[row], dense[row]) == (slot != 3)


def assert_rows_add_their_slots(layer: LoraLinear, base: Linear, x, out) -> None:
    """Each row: the base product plus its slot's shards' low-rank products."""
    for row, slot in enumerate(MIXED):
        want = base(x[row : row + 1])
        if slot >= 0:
            want = want + x[row : row + 1] @ layer.lora_a[slot].T @ layer.lora_b[slot].T
        assert_close(out[row : row + 1], want, torch.float32)


def test_a_step_too_large_for_the_dense_product_still_writes_the_mask():
    """A compiled decode program reads the mask whatever the step's size: a step of 100 rows
    with one slot of 16 active takes the per-slot loop eagerly, and its mask still says which
    rows use which slot (and nothing of an earlier step's rows)."""
    step = LoraGroups.sized(100, 16, torch.float32, torch.device(DEVICE))
    fill_groups(step, np.arange(100) % 16, torch.device(DEVICE), kernels=False)
    assert step.dense  # every slot active
    slots = np.full(100, -1)
    slots[[3, 70]] = 5
    fill_groups(step, slots, torch.device(DEVICE), kernels=False)
    assert not step.dense and len(step.groups) == 1
    assert step.mask.nonzero().tolist() == [[3, 5], [70, 5]]
