"""The model executor's side of LoRA (engine.lora.registry's LoraBackend): adapters' weights in
host memory, read and checked once (engine.lora.adapter), copied into the model's slots
(engine.layers.lora) when the registry gives one a slot; with tensor parallelism it has every
other rank load the adapter into that slot too (`broadcast`: each reads the files itself and
keeps its share). It never decides which adapter gets a slot, and never copies into a slot a
running request uses (the registry guarantees it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.layers.lora import LoraSlots
from engine.lora.adapter import LoraWeights, load_adapter


class LoraHost:
    def __init__(
        self,
        slots: LoraSlots,
        max_rank: int,
        dtype: torch.dtype,
        broadcast: Callable[[int, str], None] | None = None,
    ) -> None:
        self.slots = slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.broadcast = broadcast
        self.adapters: dict[int, tuple[str, LoraWeights]] = {}

    def read_lora(self, path: str) -> LoraWeights:
        return load_adapter(path, self.slots.shapes, self.max_rank, self.dtype)

    def load_lora(self, adapter_id: int, path: str, weights: object) -> None:
        assert isinstance(weights, LoraWeights)  # read_lora's
        self.adapters[adapter_id] = path, weights

    def drop_lora(self, adapter_id: int) -> None:
        del self.adapters[adapter_id]

    def activate_lora(self, slot: int, adapter_id: int) -> None:
        path, weights = self.adapters[adapter_id]
        if self.broadcast is not None:
            self.broadcast(slot, path)
        self.slots.load(slot, weights)
