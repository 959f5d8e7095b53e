"""Batched LoRA on the linear layers: the base product once for the whole batch, then each
adapter's low-rank product over its own rows.

`attach_lora` wraps a loaded model's q/k/v, o, gate/up and down linears (qkv_proj, o_proj,
gate_up_proj, down_proj) in `LoraLinear`, which holds `max_loras` slots of A and B stacked: a
fused module's shards side by side in A ([slots, shards * max_rank, in]) and block-diagonal in
B ([slots, out, shards * max_rank], the scaling already in B), ranks below max_rank padded with
zeros. `LoraSlots` writes an adapter's host weights (engine.lora.adapter) into a slot and, each
step, says which rows of the batch use which slot: the runner hands it the rows' slots, the
wrapped layers read the groups. On the CPU each active slot's rows go through two small matmuls
(a contiguous run of rows as a view, scattered rows gathered and added back); on a GPU the
segmented shrink/expand Triton kernels (engine.kernels.triton.lora) do every slot in two
launches. Slot -1 is the base model: its rows get nothing added. This module never reads files
and never decides which adapter is in which slot (engine.lora.registry does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from engine.core.step_plan import NewRequestPlan
from engine.layers.linear import Linear, PackedWeight, linear, pack_weight
from engine.lora.adapter import LoraWeights, ModuleShape
from engine.models.config import ModelConfig

NO_LORA = -1


@dataclass
class LoraGroups:
    """One step's rows by slot: (slot, rows) with rows a slice where they are contiguous, an
    index tensor otherwise; and for the GPU kernels, the rows sorted by slot with each
    segment's start, length and slot."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    sorted_rows: torch.Tensor | None = None
    segments: torch.Tensor | None = None  # [segments, 3]: start, length, slot


class LoraLinear(nn.Module):
    """A linear layer plus `max_loras` LoRA slots over it."""

    def __init__(
        self,
        base: nn.Module,
        shape: ModuleShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: LoraGroups,
    ) -> None:
        super().__init__()
        self.base = base
        self.max_rank = max_rank
        self.shard_offsets = np.cumsum((0, *shape.shard_rows)).tolist()
        width = len(shape.shard_rows) * max_rank
        out = self.shard_offsets[-1]
        self.lora_a = torch.zeros(max_loras, width, shape.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out, width, dtype=dtype, device=device)
        # Each slot's A and B in the form Folio's linear kernels read (engine.layers.linear):
        # torch's own bfloat16 matmul of these small shapes ran slower than the base product.
        self.packed: list[tuple[PackedWeight | None, PackedWeight | None]] = [
            (None, None)
        ] * max_loras
        self.step = step

    def load(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these shards' (A, B) (the others zero)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for shard, (a, b) in shards.items():
            cols = slice(shard * self.max_rank, shard * self.max_rank + a.shape[0])
            rows = slice(self.shard_offsets[shard], self.shard_offsets[shard + 1])
            self.lora_a[slot, cols].copy_(a)
            self.lora_b[slot, rows, cols].copy_(b)
        self.packed[slot] = (pack_weight(self.lora_a[slot]), pack_weight(self.lora_b[slot]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.step
        if step.segments is not None:
            from engine.kernels.triton.lora import lora_expand, lora_shrink

            assert step.sorted_rows is not None
            shrunk = lora_shrink(x, self.lora_a, step.sorted_rows, step.segments)
            lora_expand(shrunk, self.lora_b, step.sorted_rows, step.segments, out)
            return out
        for slot, rows in step.groups:
            packed_a, packed_b = self.packed[slot]
            shrunk = linear(x[rows], self.lora_a[slot], packed_a)
            delta = linear(shrunk, self.lora_b[slot], packed_b)
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
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
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.device = device
        self.step = LoraGroups()
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


def fill_groups(step: LoraGroups, slots: np.ndarray, device: torch.device, kernels: bool) -> None:
    """`step` for a step whose row i uses slot slots[i] (-1: the base model): per active slot
    its rows (a slice where contiguous); with `kernels`, the rows sorted by slot and the
    segments the Triton kernels take."""
    step.groups.clear()
    step.sorted_rows = step.segments = None
    active = np.unique(slots)
    active = active[active != NO_LORA]
    if len(active) == 0:
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
