"""Batched LoRA on the linear layers: the base product once for the whole batch, then each
adapter's low-rank product over its own rows.

`LoraSlots` wraps a loaded model's q/k/v, o, gate/up and down linears (qkv_proj, o_proj,
gate_up_proj, down_proj) in `LoraLinear`, which holds `max_loras` slots of A and B stacked: a
fused module's shards side by side in A ([slots, shards * max_rank, in]) and block-diagonal in
B ([slots, out, shards * max_rank], the scaling already in B), ranks below max_rank padded with
zeros. `LoraSlots` writes an adapter's host weights (engine.lora.adapter) into a slot, in place,
and, each step, says which rows of the batch use which slot: the runner hands it the rows'
slots, the wrapped layers read the step's `LoraGroups`. A step where no row uses an adapter
adds nothing. On the CPU, decode-sized steps (and steps with many slots active) take every
slot's product at once over a persistent mask of each row's slot, with no Python loop over
adapters: what compiled decode programs run (engine.compiled_decode); larger steps with few
slots active take each active slot's two small matmuls over its rows (a contiguous run of rows
as a view, scattered rows gathered and added back); on a GPU the segmented shrink/expand
Triton kernels (engine.kernels.triton.lora) do every slot in two launches. Slot -1 is the base
model: its rows get nothing added. This module never reads files and never decides which
adapter is in which slot (engine.lora.registry does)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.core.step_plan import NewRequestPlan
from engine.layers.linear import (
    Bf16Tiles,
    Linear,
    PackedWeight,
    RowParallelLinear,
    linear,
    pack_weight,
)
from engine.layers.parallel import CheckpointSlice
from engine.lora.adapter import LoraWeights, ModuleShape
from engine.models.config import ModelConfig

NO_LORA = -1
# Steps of at most this many tokens (decode steps, compiled or not) take every slot's product
# at once (`dense`); larger ones (prompts) take each active slot's own over its rows, unless
# 1 / DENSE_SLOT_SHARE of the slots or more are active: the loop's small products, one pair
# per active slot per linear, then cost more than the dense one's unused slots.
DENSE_MAX_TOKENS = 64
DENSE_SLOT_SHARE = 4


@dataclass
class LoraGroups:
    """One step's rows by slot. `active`: some row uses an adapter (otherwise the wrapped layers
    add nothing). On the CPU, `dense` steps read `mask`, a persistent [max tokens, slots] one-hot
    of each token's slot (zero rows for the base model) that compiled decode programs read too;
    other steps read `groups`: (slot, rows) with rows a slice where they are contiguous, an
    index tensor otherwise. For the GPU kernels, the rows sorted by slot with each segment's
    start, length and slot."""

    mask: torch.Tensor
    active: bool = False
    dense: bool = False
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    sorted_rows: torch.Tensor | None = None
    segments: torch.Tensor | None = None  # [segments, 3]: start, length, slot

    @classmethod
    def sized(
        cls, max_tokens: int, max_loras: int, dtype: torch.dtype, device: torch.device
    ) -> LoraGroups:
        return cls(torch.zeros(max_tokens, max_loras, dtype=dtype, device=device))


def pack_persistent(weight: torch.Tensor) -> PackedWeight | None:
    """`weight`'s packed form for a tensor rewritten in place later (`copy_packed`): the same
    form whatever its values, so never bfloat16 tiles of float32 (its zeros are bfloat16
    values, an adapter's weights need not be): torch's F.linear there instead."""
    packed = pack_weight(weight)
    if isinstance(packed, Bf16Tiles) and packed.widened:
        return None
    return packed


def copy_packed(weight: torch.Tensor, packed: PackedWeight | None, value: torch.Tensor) -> None:
    """Write `value` into `weight` and its packed form in place: a compiled program reads the
    same tensors from then on."""
    weight.copy_(value)
    fresh = pack_persistent(weight)
    if isinstance(packed, Bf16Tiles):
        assert isinstance(fresh, Bf16Tiles)
        packed.tiles.copy_(fresh.tiles)
    elif isinstance(packed, torch.Tensor):
        assert isinstance(fresh, torch.Tensor)
        packed.copy_(fresh)


class LoraLinear(nn.Module):
    """A linear layer plus `max_loras` LoRA slots over it.

    On the CPU every slot's weights are also held in the form of one product for all slots
    (`dense`): A of every slot stacked shard-major ([shards * slots * max_rank, in]: one shrink
    for the whole step), and per shard the slots' B side by side ([shard rows, slots *
    max_rank]); each token's shrunk values are masked to its own slot's before the expand. No
    Python loop over adapters, nothing that depends on which slots a step uses: compiled
    decode programs take it whole."""

    def __init__(
        self,
        base: Linear,
        shape: ModuleShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: LoraGroups,
    ) -> None:
        """`shape` is the whole module's (an adapter's); with tensor parallelism the slots hold
        this rank's share, as `base` does: of B's rows of each shard for a column-parallel
        layer, of A's columns for a row-parallel one (whose partial products, the adapter's
        included, the base layer's all-reduce sums)."""
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
        self.shard_offsets = np.cumsum((0, *shape.shard_rows)).tolist()
        self.num_shards = len(shape.shard_rows)
        width = self.num_shards * max_rank
        out = self.shard_offsets[-1]
        self.lora_a = torch.zeros(max_loras, width, shape.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out, width, dtype=dtype, device=device)
        self.step = step
        # The stacked forms are the CPU's (a GPU runs the Triton kernels over lora_a/lora_b):
        # none elsewhere.
        dense_shapes = [] if device.type != "cpu" else [(max_loras * width, shape.in_features)]
        if dense_shapes:
            dense_shapes += [(rows, max_loras * max_rank) for rows in shape.shard_rows]
        dense = [torch.zeros(size, dtype=dtype, device=device) for size in dense_shapes]
        # Each with its form for Folio's linear kernels (engine.layers.linear): torch's own
        # bfloat16 matmul of these small shapes ran slower than the base product.
        self.dense: list[tuple[torch.Tensor, PackedWeight | None]] = [
            (weight, pack_persistent(weight)) for weight in dense
        ]

    def load(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these shards' (A, B) (the others zero), written in place."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for shard, (a, b) in shards.items():
            if self.column_slice is not None:
                held = self.column_slice
                a = a[:, held.start : held.start + held.count]
            if self.row_slices is not None:
                rows_held = self.row_slices[shard]
                b = b[rows_held.start : rows_held.start + rows_held.count]
            cols = slice(shard * self.max_rank, shard * self.max_rank + a.shape[0])
            rows = slice(self.shard_offsets[shard], self.shard_offsets[shard + 1])
            self.lora_a[slot, cols].copy_(a)
            self.lora_b[slot, rows, cols].copy_(b)
        if not self.dense:
            return
        slots, shards_n, rank = self.max_loras, self.num_shards, self.max_rank
        (dense_a, packed_a), *dense_bs = self.dense
        # A's rows shard-major: [shard, slot, rank].
        stacked = (
            self.lora_a.view(slots, shards_n, rank, -1)
            .transpose(0, 1)
            .reshape(shards_n * slots * rank, -1)
        )
        copy_packed(dense_a, packed_a, stacked)
        for shard, (dense_b, packed_b) in enumerate(dense_bs):
            rows = slice(self.shard_offsets[shard], self.shard_offsets[shard + 1])
            cols = slice(shard * rank, (shard + 1) * rank)
            # [rows, slot, rank]: slot s's B of this shard in columns s * rank onwards.
            block = self.lora_b[:, rows, cols].permute(1, 0, 2).reshape(dense_b.shape[0], -1)
            copy_packed(dense_b, packed_b, block)

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
        if step.dense:
            return self._add_dense(x, out)
        for slot, rows in step.groups:
            shrunk = F.linear(x[rows], self.lora_a[slot])
            delta = F.linear(shrunk, self.lora_b[slot])
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out

    def _add_dense(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every slot's product at once: shrink by all slots, keep each token's slot's values
        (the mask), expand per shard by all slots into the shard's columns."""
        tokens, slots, rank = x.shape[0], self.max_loras, self.max_rank
        (dense_a, packed_a), *dense_bs = self.dense
        shrunk = linear(x, dense_a, packed_a).view(tokens, self.num_shards, slots, rank)
        shrunk = shrunk * self.step.mask[:tokens].view(tokens, 1, slots, 1)
        for shard, (dense_b, packed_b) in enumerate(dense_bs):
            delta = linear(shrunk[:, shard].reshape(tokens, slots * rank), dense_b, packed_b)
            if self.num_shards == 1:
                out += delta
            else:
                out[:, self.shard_offsets[shard] : self.shard_offsets[shard + 1]] += delta
        return out


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
        self.step = LoraGroups.sized(max_tokens, max_loras, dtype, device)
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
        """Steps as a compiled decode program sees them while it is traced: every slot's
        product at once (`active`), or none (no adapter in the step)."""
        saved = self.step.active, self.step.dense
        self.step.active = self.step.dense = active
        try:
            yield
        finally:
            self.step.active, self.step.dense = saved


def fill_groups(
    step: LoraGroups,
    slots: np.ndarray,
    device: torch.device,
    kernels: bool,
    dense: bool | None = None,
) -> None:
    """`step` for a step whose row i uses slot slots[i] (-1: the base model). With `kernels`,
    the rows sorted by slot and the segments the Triton kernels take. Else the mask of every
    row's slot (a compiled decode program reads it whatever the step's size), and unless the
    step is `dense` (None: up to DENSE_MAX_TOKENS rows, or many slots active) per active slot
    its rows (a slice where contiguous)."""
    step.groups.clear()
    step.sorted_rows = step.segments = None
    used = slots != NO_LORA
    step.active = bool(used.any())
    step.dense = False
    if not step.active:
        return
    active = np.unique(slots[used])
    if not kernels:
        mask = step.mask[: len(slots)]
        mask.zero_()
        (rows,) = np.nonzero(used)
        mask[torch.from_numpy(rows), torch.from_numpy(slots[rows])] = 1
        if dense is None:
            many = len(active) * DENSE_SLOT_SHARE >= step.mask.shape[1]
            dense = len(slots) <= DENSE_MAX_TOKENS or many
        step.dense = dense
        if dense:
            return
    counts = []
    for slot in active.tolist():
        (rows,) = np.nonzero(slots == slot)
        counts.append(len(rows))
        first, last = int(rows[0]), int(rows[-1])
        if last - first + 1 == len(rows):
            step.groups.append((slot, slice(first, last + 1)))
        else:
            step.groups.append((slot, torch.from_numpy(rows).to(device)))
    if kernels:
        order = np.argsort(slots, kind="stable")
        order = order[slots[order] != NO_LORA]
        starts = np.cumsum([0, *counts[:-1]])
        segments = np.stack([starts, counts, active], axis=1).astype(np.int32)
        step.sorted_rows = torch.from_numpy(order.astype(np.int32)).to(device)
        step.segments = torch.from_numpy(segments).to(device)
