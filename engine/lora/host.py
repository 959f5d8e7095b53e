"""The model executor's side of LoRA (engine.lora.registry's LoraBackend): adapters' weights in
host memory, read and checked once (engine.lora.adapter), copied into the model's slots
(engine.layers.lora) when the registry gives one a slot. With tensor parallelism rank 0 tells
the other ranks (`broadcast`) of each adapter it loads, puts into a slot and forgets; each rank
(WorkerLoras) reads its share of an adapter on a thread of its own as soon as it hears of it
and keeps it, so that putting an adapter into a slot, inside a step, only copies on every rank.
It never decides which adapter gets a slot, and never copies into a slot a running request uses
(the registry guarantees it).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.layers.lora import LoraSlots
from engine.lora.adapter import LoraWeights, load_adapter

# The operations of rank 0's LoRA messages to the other ranks (engine.distributed's LORA, with
# the adapter's id, a slot and a path): READ an adapter from the path, ACTIVATE one into the slot,
# DROP one.
READ, ACTIVATE, DROP = 0, 1, 2
NO_SLOT = -1

Broadcast = Callable[[int, int, int, str], None]


class LoraHost:
    def __init__(
        self,
        slots: LoraSlots,
        max_rank: int,
        dtype: torch.dtype,
        broadcast: Broadcast | None = None,
    ) -> None:
        self.slots = slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.broadcast = broadcast
        self.adapters: dict[int, LoraWeights] = {}

    def read_lora(self, path: str) -> LoraWeights:
        return load_adapter(path, self.slots.shapes, self.max_rank, self.dtype)

    def load_lora(self, adapter_id: int, path: str, weights: object) -> None:
        assert isinstance(weights, LoraWeights)  # read_lora's
        self.adapters[adapter_id] = weights
        if self.broadcast is not None:
            self.broadcast(READ, adapter_id, NO_SLOT, path)

    def drop_lora(self, adapter_id: int) -> None:
        del self.adapters[adapter_id]
        if self.broadcast is not None:
            self.broadcast(DROP, adapter_id, NO_SLOT, "")

    def activate_lora(self, slot: int, adapter_id: int) -> None:
        if self.broadcast is not None:
            self.broadcast(ACTIVATE, adapter_id, slot, "")
        self.slots.load(slot, self.adapters[adapter_id])


class WorkerLoras:
    """A tensor-parallel worker rank's adapters: each read (its share) on a reading thread when
    rank 0 loads it, and copied into a slot when rank 0 says so, waiting for its read only if
    that is still running. Rank 0 checked the files: a read failing here (the files changed
    since) raises at the adapter's activation, which breaks the group as any failed step does."""

    def __init__(self, slots: LoraSlots, max_rank: int, dtype: torch.dtype) -> None:
        self.slots = slots
        self.max_rank = max_rank
        self.dtype = dtype
        self._reads: dict[int, Future[LoraWeights]] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="folio-lora-read")

    def receive(self, operation: int, adapter_id: int, slot: int, path: str) -> None:
        """One of rank 0's messages (LoraHost's broadcast)."""
        if operation == READ:
            self._reads[adapter_id] = self._reader.submit(
                load_adapter, path, self.slots.shapes, self.max_rank, self.dtype
            )
        elif operation == ACTIVATE:
            self.slots.load(slot, self._reads[adapter_id].result())
        elif operation == DROP:
            self._reads.pop(adapter_id).cancel()
        else:
            raise ValueError(f"unknown LoRA message {operation} from rank 0")

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
