"""The segmented LoRA kernels (shrink into the narrow intermediate, expand added into the base
output) against the plain loop over segments, under the Triton interpreter (or natively with
FOLIO_KERNEL_DEVICE=cuda): uneven segments, rows of the base model in none, a slot unused,
widths and outputs that are no power of two (masked tiles); and engine.layers.lora's wrapped
linear gives the same output through the kernels as through its CPU product (Folio's grouped
kernel where it loaded)."""

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
    step = LoraGroups.sized(len(slots), torch.device(DEVICE))
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
    """A fused three-shard linear with ranks 3 and 2 in a slot of width 4 per shard: on the
    CPU (Folio's grouped kernel, B in tiles) each row gets its slot's shards' low-rank
    products, and the Triton kernels (B block-diagonal) give the same; then a slot loaded
    again in place changes the rows of that slot only."""
    shape = ModuleShape(IN, (24, 16, 16))
    base = Linear(IN, list(shape.shard_rows), False, torch.float32, "cpu")
    base.weight.data.copy_(randn(56, IN, dtype=torch.float32, seed=5, scale=0.2).cpu())
    cpu = torch.device("cpu")
    step = LoraGroups.sized(len(MIXED), cpu)
    layer = LoraLinear(base, shape, SLOTS, 4, torch.float32, cpu, step)
    assert layer.tiled_b
    kernels_base = Linear(IN, list(shape.shard_rows), False, torch.float32, DEVICE)
    kernels_base.weight.data.copy_(base.weight.data)
    kernels_layer = LoraLinear(
        kernels_base,
        shape,
        SLOTS,
        4,
        torch.float32,
        torch.device(DEVICE),
        kernel_groups(MIXED),
        segmented=True,
    )
    loaded: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for slot, rank in ((0, 3), (2, 2), (3, 4)):
        loaded[slot] = {
            s: (
                randn(rank, IN, dtype=torch.float32, seed=10 * slot + s, scale=0.3),
                randn(shape.shard_rows[s], rank, dtype=torch.float32, seed=99 - s, scale=0.3),
            )
            for s in range(3)
            if (slot, s) != (2, 1)  # slot 2 leaves its second shard out
        }
        layer.load(slot, loaded[slot])
        kernels_layer.load(slot, loaded[slot])
    x = randn(len(MIXED), IN, dtype=torch.float32, seed=6).cpu()
    fill_groups(step, np.array(MIXED), cpu, kernels=False)
    assert step.active and step.segments is None
    cpu_path = layer(x)
    assert_rows_add_their_slots(base, loaded, x, cpu_path)
    assert_close(kernels_layer(x.to(DEVICE)).cpu(), cpu_path, torch.float32)
    # Slot 3 again, other weights, in place: the rows of slot 3 change, the others stay.
    loaded[3] = {
        0: (
            randn(4, IN, dtype=torch.float32, seed=7, scale=0.3),
            randn(24, 4, dtype=torch.float32, seed=8, scale=0.3),
        )
    }
    layer.load(3, loaded[3])
    reloaded = layer(x)
    assert_rows_add_their_slots(base, loaded, x, reloaded)
    for row, slot in enumerate(MIXED):
        assert torch.equal(reloaded[row], cpu_path[row]) == (slot != 3)


def assert_rows_add_their_slots(base: Linear, loaded, x, out) -> None:
    """Each row: the base product plus its slot's shards' low-rank products."""
    bounds = [0, 24, 40, 56]
    for row, slot in enumerate(MIXED):
        want = base(x[row : row + 1])
        for shard, (a, b) in loaded.get(slot, {}).items():  # none for the base model (-1)
            delta = x[row : row + 1] @ a.cpu().T @ b.cpu().T
            want[:, bounds[shard] : bounds[shard + 1]] += delta
        assert_close(out[row : row + 1], want, torch.float32)


def test_fill_groups_writes_each_rows_slot_or_nothing():
    """A CPU step writes every row's slot into the persistent slots (what compiled decode
    programs read, whatever the step's size); a step with no adapter is not active."""
    step = LoraGroups.sized(100, torch.device("cpu"))
    slots = np.full(100, -1)
    slots[[3, 70]] = 5
    fill_groups(step, slots, torch.device("cpu"), kernels=False)
    assert step.active and step.slots.tolist() == slots.tolist()
    fill_groups(step, np.full(8, -1), torch.device("cpu"), kernels=False)
    assert not step.active
