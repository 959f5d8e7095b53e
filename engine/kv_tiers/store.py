"""The tiers' data path in the model executor: moves KV blocks between the pool's tensors, the
host tier (engine.kv_tiers.host_tier) and the disk tier (engine.kv_tiers.disk_tier).

Per step, before the forward (`apply`): the blocks the step's allocations evicted are gathered
from the pool in one indexed copy per layer and stored in their host slots, then the blocks
claimed from the tiers are written into their fresh pool blocks, again one indexed copy per
layer; after the step (`persist`, through the book's sink) the blocks newly cached are gathered
once and queued, as bytes, for the disk tier's writer thread. Batched per step, never per block;
on CUDA the host side is pinned memory. The host-side work runs on one torch thread: it is
memory-bound, and torch's intra-op threads only wait on each other there (on the shared 2-core
host, a restart's 62-block scatter took 350 ms on two threads and 27 ms on one; dequantizing 16
blocks 12 ms and 1 ms).

Built only where tiers are asked for (`create`), with the start-up checks that name the flag.
It never decides which block goes where (the book does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from common.config import EngineConfig
from engine.kv_tiers.book import TierBook, TierTransfers
from engine.kv_tiers.disk_tier import DiskTier, model_identity
from engine.kv_tiers.host_tier import HostTier, bytes_per_block, resolve_format

GIB = 1024**3


class KVTierStore:
    def __init__(self, kv_slots: list[torch.Tensor], book: TierBook, host: HostTier | None) -> None:
        self.kv_slots = kv_slots
        _, _, block_size, heads, head_dim = kv_slots[0].shape
        self.block_shape = (len(kv_slots), 2, block_size, heads, head_dim)
        self.dtype = kv_slots[0].dtype
        self.device = kv_slots[0].device
        self.book = book
        self.host = host
        book.sink = self.persist

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        kv_slots: list[torch.Tensor],
        num_groups: int,
        model_path: Path,
        quantization: str | None,
    ) -> KVTierStore | None:
        """The store and its book, or None when no tier is asked for; ValueError in one line
        naming the flag when the tiers cannot serve this engine."""
        if not config.kv_offload_gib and config.kv_cache_dir is None:
            return None
        if config.tensor_parallel_size > 1 or num_groups > 1:
            raise ValueError(
                "--kv-offload-gib / --kv-cache-dir: KV cache tiers serve one-rank models without "
                f"sliding windows (tensor_parallel_size {config.tensor_parallel_size}, "
                f"{num_groups} KV groups)"
            )
        _, _, block_size, heads, head_dim = kv_slots[0].shape
        shape = (len(kv_slots), 2, block_size, heads, head_dim)
        dtype, device = kv_slots[0].dtype, kv_slots[0].device
        host = None
        if config.kv_offload_gib:
            fmt = resolve_format(config.kv_offload_format, device)
            per_block = bytes_per_block(shape, dtype, fmt)
            num_slots = int(config.kv_offload_gib * GIB) // per_block
            if num_slots < 1:
                raise ValueError(
                    f"--kv-offload-gib {config.kv_offload_gib:g} is below one KV block "
                    f"({per_block} bytes in the {fmt} format); raise it"
                )
            host = HostTier(num_slots, shape, dtype, fmt, pin=device.type == "cuda")
        disk = None
        if config.kv_cache_dir is not None:
            identity = {
                "format": 1,
                "model": model_identity(model_path),
                "dtype": str(dtype),
                "block_size": block_size,
                "tensor_parallel_size": config.tensor_parallel_size,
                "quantization": quantization,
                "kv_shape": list(shape),
            }
            disk = DiskTier(
                config.kv_cache_dir,
                int(config.kv_cache_dir_gib * GIB),
                bytes_per_block(shape, dtype, "native"),
                identity,
            )
        book = TierBook(host.data.shape[0] if host is not None else 0, disk, block_size)
        return cls(kv_slots, book, host)

    def _gather(self, blocks: list[int]) -> torch.Tensor:
        """[n, layers, 2, block_size, heads, head_dim] copies of pool blocks, on the host."""
        index = torch.tensor(blocks, device=self.device)
        gathered = torch.stack([kv.index_select(1, index) for kv in self.kv_slots])
        return gathered.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()

    def _scatter(self, blocks: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(blocks, device=self.device)
        data = data.to(self.device, non_blocking=True)
        for layer, kv in enumerate(self.kv_slots):
            kv.index_copy_(1, index, data[:, layer].transpose(0, 1))

    def apply(self, transfers: TierTransfers) -> None:
        """The step's saves, then its loads (a block evicted this step may be loaded into)."""
        with one_thread():
            self._apply(transfers)

    def _apply(self, transfers: TierTransfers) -> None:
        if transfers.saves:
            assert self.host is not None, "saves without a host tier"
            blocks, slots = zip(*transfers.saves, strict=True)
            self.host.store(torch.tensor(slots), self._gather(list(blocks)))
        if transfers.host_loads:
            assert self.host is not None, "host loads without a host tier"
            slots, blocks = zip(*transfers.host_loads, strict=True)
            self._scatter(list(blocks), self.host.fetch(torch.tensor(slots)))
        if transfers.disk_loads:
            payloads, blocks = zip(*transfers.disk_loads, strict=True)
            raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
            data = raw.view(self.dtype).reshape(len(blocks), *self.block_shape)
            self._scatter(list(blocks), data)

    def persist(self, persists: list[tuple[int, bytes]]) -> None:
        """Queue the newly cached blocks' files (the disk tier writes them in its thread)."""
        disk = self.book.disk
        if not persists or disk is None:
            return
        blocks, hashes = zip(*persists, strict=True)
        with one_thread():
            data = self._gather(list(blocks))
        for block_hash, block in zip(hashes, data, strict=True):
            disk.write(block_hash, block.view(torch.uint8).numpy().tobytes())


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one for the block, then back (a free switch)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
