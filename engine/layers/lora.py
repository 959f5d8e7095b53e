"""Batched LoRA on the linear layers: the base product once for the whole batch, then each
adapter's low-rank product over its own rows.

`LoraSlots` wraps a loaded model's q/k/v, o, gate/up and down linears (qkv_proj, o_proj,
gate_up_proj, down_proj) in `LoraLinear`, which holds `max_loras` slots of A and B stacked: a
fused module's shards side by side in A ([slots, shards * max_rank, in]) and in B's output
columns, the scaling already in B, ranks below max_rank padded with zeros. `LoraSlots` writes
an adapter's host weights (engine.lora.adapter) into a slot, in place, and, each step, says
which rows of the batch use which slot: the runner hands it the rows' slots, the wrapped layers
read the step's `LoraGroups`. A step where no row uses an adapter adds nothing. On the CPU,
every step (decode steps in compiled programs included, engine.compiled_decode) takes one call
of Folio's grouped kernel per wrapped linear (engine/kernels/cpu/cpu_lora.cpp,
folio_lora::lora_add) over a persistent tensor of each token's slot: the rows grouped by slot,
each used slot's A and B read once, each row doing its own slot's arithmetic only; where Folio's
kernels did not load, torch's ops do the same per used slot (folio::lora_add, also one op to a
compiled program). On a GPU the segmented shrink/expand Triton kernels
(engine.kernels.triton.lora) do every slot in two launches. Slot -1 is the base model: its
rows get nothing added. This module never reads files and never decides which adapter is in
which slot (engine.lora.registry does)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.core.step_plan import NewRequestPlan
from engine.kernels.cpu.capabilities import cpu_capabilities, forced_isa
from engine.layers.linear import Linear, RowParallelLinear, linear
from engine.layers.parallel import CheckpointSlice
from engine.lora.adapter import LoraWeights, ModuleShape
from engine.models.config import ModelConfig

NO_LORA = -1
# Output columns of a tile of B on the CPU (engine/kernels/cpu/cpu_lora.cpp): a tile's rank x
# TILE values lie together, so the kernel reads each slot's B front to back.
TILE = 32
# The codes folio_lora::lora_add may run, its `isa` (the most it may use; it runs the best the CPU
# has up to that): AVX2, AVX-512, and AVX-512 with bfloat16's shrink in vdpbf16ps.
ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16 = 0, 1, 2


@dataclass
class LoraGroups:
    """One step's rows by slot. `active`: some row uses an adapter (otherwise the wrapped layers
    add nothing). On the CPU, `slots`: a persistent [max tokens] int32 tensor of each token's
    slot (-1 for the base model), written each step, that compiled decode programs read too.
    For the GPU kernels, the rows sorted by slot with each segment's start, length and slot."""

    slots: torch.Tensor
    active: bool = False
    sorted_rows: torch.Tensor | None = None
    segments: torch.Tensor | None = None  # [segments, 3]: start, length, slot

    @classmethod
    def sized(cls, max_tokens: int, device: torch.device) -> LoraGroups:
        return cls(torch.full((max_tokens,), NO_LORA, dtype=torch.int32, device=device))


class LoraLinear(nn.Module):
    """A linear layer plus `max_loras` LoRA slots over it.

    `lora_a` [slots, shards * max_rank, in] holds each slot's A, its shards' one after the
    other. `lora_b` holds each slot's B, laid out for the product that reads it: on the CPU
    in tiles of TILE output columns, [slots, tiles, max_rank, TILE] (`b_tiles`: Folio's grouped
    kernel; shard k's tiles multiply A's rows of shard k, so no zeros between shards are
    stored or read); on a GPU [slots, out, shards * max_rank] with each shard's block on the
    diagonal (the Triton kernels')."""

    def __init__(
        self,
        base: Linear,
        shape: ModuleShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: LoraGroups,
        segmented: bool | None = None,
    ) -> None:
        """`shape` is the whole module's (an adapter's); with tensor parallelism the slots hold
        this rank's share, as `base` does: of B's rows of each shard for a column-parallel
        layer, of A's columns for a row-parallel one (whose partial products, the adapter's
        included, the base layer's all-reduce sums). `segmented`: the Triton kernels read the
        slots (None: on a GPU; the interpreter runs them on a CPU in tests)."""
        super().__init__()
        self.base = base
        self.row_slices: list[CheckpointSlice] | None = base.checkpoint_rows
        self.column_slice: CheckpointSlice | None = None
        if isinstance(base, RowParallelLinear):
            self.column_slice = base.checkpoint_columns
        shape = ModuleShape(
            shape.in_features if self.column_slice is None else self.column_slice.count,
            tuple(base.output_sizes),
        )
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.shard_outputs = list(shape.shard_rows)
        self.shard_offsets = np.cumsum((0, *shape.shard_rows)).tolist()
        width = len(shape.shard_rows) * max_rank
        out = self.shard_offsets[-1]
        self.lora_a = torch.zeros(max_loras, width, shape.in_features, dtype=dtype, device=device)
        self.tiled_b = not (device.type == "cuda" if segmented is None else segmented)
        self.tile_offsets = np.cumsum(
            (0, *(-(-rows // TILE) for rows in shape.shard_rows))
        ).tolist()
        tiles = self.tile_offsets[-1]
        b_shape = (tiles, max_rank, TILE) if self.tiled_b else (out, width)
        self.lora_b = torch.zeros(max_loras, *b_shape, dtype=dtype, device=device)
        self.step = step
        # Decided here, not in a step: a compiled program keeps the choice as a constant.
        cpu = self.tiled_b and device.type == "cpu"
        self.folio_kernel = cpu and cpu_capabilities().folio_kernels
        self.isa = ISA_AVX512_BF16 if forced_isa() == "native" else ISA_AVX2

    def load(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these shards' (A, B) (the others zero), written in place: a
        compiled program reads the same tensors from then on."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for shard, (a, b) in shards.items():
            if self.column_slice is not None:
                held = self.column_slice
                a = a[:, held.start : held.start + held.count]
            if self.row_slices is not None:
                rows_held = self.row_slices[shard]
                b = b[rows_held.start : rows_held.start + rows_held.count]
            rank = a.shape[0]
            cols = slice(shard * self.max_rank, shard * self.max_rank + rank)
            rows = slice(self.shard_offsets[shard], self.shard_offsets[shard + 1])
            self.lora_a[slot, cols].copy_(a)
            if self.tiled_b:
                first, end = self.tile_offsets[shard : shard + 2]
                self.lora_b[slot, first:end, :rank].copy_(b_tiles(b))
            else:
                self.lora_b[slot, rows, cols].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.step
        if not step.active:
            return self.base(x)
        base = self.base
        if isinstance(base, RowParallelLinear):
            # The adapter's partial product joins the base layer's before the all-reduce.
            return base.reduce(self._add(x, linear(x, base.weight, base.packed)))
        return self._add(x, base(x))

    def _add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus each row's slot's low-rank product."""
        step = self.step
        if step.segments is not None:
            from engine.kernels.triton.lora import lora_expand, lora_shrink

            assert step.sorted_rows is not None
            shrunk = lora_shrink(x, self.lora_a, step.sorted_rows, step.segments)
            lora_expand(shrunk, self.lora_b, step.sorted_rows, step.segments, out)
            return out
        slots = step.slots[: x.shape[0]]
        if self.folio_kernel:
            return torch.ops.folio_lora.lora_add(
                out, x, slots, self.lora_a, self.lora_b, self.shard_outputs, self.isa
            )
        return torch_lora_add(out, x, slots, self.lora_a, self.lora_b, self.shard_outputs)


@torch.library.custom_op("folio::lora_add", mutates_args=())
def torch_lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    shard_outputs: list[int],
) -> torch.Tensor:
    """folio_lora::lora_add's contract (engine/kernels/cpu/cpu_lora.cpp) in torch's ops, where
    Folio's kernels did not load: y plus, per used slot, its two products over its rows (b in
    tiles, [slots, tiles, rank, TILE]). One op to a compiled program, as the kernel is."""
    out = y.clone()
    _, _, rank, tile = b.shape
    slot_of = slots.numpy()
    for slot in np.unique(slot_of[slot_of != NO_LORA]).tolist():
        rows = torch.from_numpy(np.flatnonzero(slot_of == slot))
        shrunk = F.linear(x[rows], a[slot])
        # [rank, tiles * TILE]: the slot's B transposed, each shard's columns padded to tiles.
        flat = b[slot].transpose(0, 1).reshape(rank, -1)
        deltas, first = [], 0
        for k, count in enumerate(shard_outputs):
            b_k = flat[:, first * tile : first * tile + count]
            deltas.append(shrunk[:, k * rank : (k + 1) * rank] @ b_k)
            first += -(-count // tile)
        out.index_add_(0, rows, torch.cat(deltas, dim=1))
    return out


@torch_lora_add.register_fake
def _torch_lora_add_shape(
    y: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    shard_outputs: list[int],
) -> torch.Tensor:
    return torch.empty_like(y)


def b_tiles(b: torch.Tensor) -> torch.Tensor:
    """One shard's B [rows, rank] as Folio's CPU kernel reads it: [ceil(rows / TILE), rank,
    TILE], tile t holding B's rows t * TILE onwards transposed, zeros past the last."""
    rows, rank = b.shape
    count = -(-rows // TILE)
    padded = b.new_zeros(count * TILE, rank)
    padded[:rows] = b
    return padded.view(count, TILE, rank).transpose(1, 2)


def module_shapes(config: ModelConfig) -> dict[str, ModuleShape]:
    """Each LoRA-capable module of a decoder layer (Folio's names), with one rank."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q, kv = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    return {
        "self_attn.qkv_proj": ModuleShape(hidden, (q, kv, kv)),
        "self_attn.o_proj": ModuleShape(q, (hidden,)),
        "mlp.gate_up_proj": ModuleShape(hidden, (inner, inner)),
        "mlp.down_proj": ModuleShape(inner, (hidden,)),
    }


class LoraSlots:
    """The model's LoRA slots: what an adapter must look like, loading one into a slot, and
    each step's rows by slot."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        max_rows: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.step = LoraGroups.sized(max_tokens, device)
        self.layers: dict[tuple[int, str], LoraLinear] = {}
        self.shapes: dict[tuple[int, str], ModuleShape] = {}
        per_layer = module_shapes(config)
        layers = model.get_submodule("model.layers")
        assert isinstance(layers, nn.ModuleList), "a decoder's layers are a ModuleList"
        for index, layer in enumerate(layers):
            for name, shape in per_layer.items():
                block, attr = name.split(".")
                parent = getattr(layer, block)
                base = getattr(parent, attr, None)
                # A mixture of experts' MLP has no gate_up_proj: LoRA there is refused.
                if not isinstance(base, Linear):
                    continue
                wrapped = LoraLinear(base, shape, max_loras, max_rank, dtype, device, self.step)
                setattr(parent, attr, wrapped)
                self.layers[index, name] = wrapped
                self.shapes[index, name] = shape
        self.row_slots = np.full(max_rows, NO_LORA, dtype=np.int64)

    def load(self, slot: int, weights: LoraWeights) -> None:
        for key, layer in self.layers.items():
            layer.load(slot, weights.modules.get(key, {}))

    def join(self, new_requests: list[NewRequestPlan], row_of: dict[int, int]) -> None:
        """The rows a step plan adds use their requests' slots."""
        for new in new_requests:
            self.row_slots[row_of[new.seq_id]] = new.lora_slot

    def prepare(self, token_rows: np.ndarray) -> None:
        """This step's groups: `token_rows` is each flat token's batch row."""
        fill_groups(self.step, self.row_slots[token_rows], self.device, self.device.type == "cuda")

    @contextlib.contextmanager
    def tracing(self, active: bool) -> Iterator[None]:
        """Steps as a compiled decode program sees them while it is traced: with adapters
        (`active`: the grouped product over the step's slots), or with none."""
        saved = self.step.active
        self.step.active = active
        try:
            yield
        finally:
            self.step.active = saved


def fill_groups(step: LoraGroups, slots: np.ndarray, device: torch.device, kernels: bool) -> None:
    """`step` for a step whose row i uses slot slots[i] (-1: the base model). With `kernels`
    (the GPU's), the rows sorted by slot and the segments the Triton kernels take; else the
    persistent slots of the step's rows (what the CPU's product and compiled decode programs
    read)."""
    step.sorted_rows = step.segments = None
    used = slots != NO_LORA
    step.active = bool(used.any())
    if not step.active:
        return
    if not kernels:
        step.slots[: len(slots)].copy_(torch.from_numpy(slots.astype(np.int32)))
        return
    active, counts = np.unique(slots[used], return_counts=True)
    order = np.argsort(slots, kind="stable")
    order = order[slots[order] != NO_LORA]
    starts = np.cumsum([0, *counts[:-1]])
    segments = np.stack([starts, counts, active], axis=1).astype(np.int32)
    step.sorted_rows = torch.from_numpy(order.astype(np.int32)).to(device)
    step.segments = torch.from_numpy(segments).to(device)
