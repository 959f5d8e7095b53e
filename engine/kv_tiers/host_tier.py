"""The host tier's storage: a bounded array of block slots in host memory.

Two formats. `native`: the pool's dtype as it is (pinned memory on CUDA, so copies to and from
the device are DMA). `int8`: on the CPU, where the pool already is host memory, the tier is only
worth having if it holds more than the pool would: K and V are quantized to 8 bits with one
symmetric float32 scale per block, layer and K|V (absmax / 127 over the block's tokens, heads
and head dimension), about a quarter of float32's bytes and half of bfloat16's. The error is
at most half a step of that scale per value (docs/kv_tiers.md gives measured figures).

A slot holds one block of every layer. The storage is laid out like the pool, layer-major:
[layers, 2 (K, V), slots, block_size, kv_heads, head_dim], so the blocks the store gathers from
the pool ([layers, 2, n, ...], one indexed copy per layer) go in, and come out for the pool, with
one indexed copy and no transpose. This module stores and returns tensors by slot; which slot
holds what is engine.kv_tiers.book's. It runs on the store's save thread and on the engine's:
the store (engine.kv_tiers.store) sees to it that no two touch one slot at once.
"""

from __future__ import annotations

import torch

from engine.attention.kv_dtype import copyable

FORMATS = ("auto", "int8", "native")


def resolve_format(fmt: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: int8 on the CPU, native (pinned host memory) on a GPU; native for a pool of one
    byte a value (--kv-cache-dtype fp8*), which int8 would only make lossier."""
    if dtype.itemsize == 1:
        if fmt == "int8":
            raise ValueError(
                f"kv_offload_format int8 over a {str(dtype).removeprefix('torch.')} KV pool "
                "(one byte a value already): use kv_offload_format native or auto"
            )
        return "native"
    if fmt == "auto":
        return "int8" if device.type == "cpu" else "native"
    return fmt


def bytes_per_block(block_shape: tuple[int, ...], dtype: torch.dtype, fmt: str) -> int:
    layers, _, block_size, heads, head_dim = block_shape
    values = layers * 2 * block_size * heads * head_dim
    if fmt == "int8":
        return values + layers * 2 * 4  # and the float32 scales
    return values * torch.empty((), dtype=dtype).element_size()


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., run] -> int8 values of that shape and float32 scales [...]: one symmetric scale
    per run (a block's tokens, heads and head dimension of one layer's K or V)."""
    rows = values.reshape(-1, values.shape[-1])
    x = rows.to(torch.float32, copy=True)  # divided in place
    # abs().amax(), not vector_norm(ord=inf): on the CPU the norm's reduction is not
    # vectorized (7 ms against 0.5 ms on the 2.6M values of 14 blocks of SmolLM2-135M).
    scales = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)
    # |x / scale| <= 127 by construction: no clamp needed.
    q = x.div_(scales).round_().to(torch.int8)
    return q.view(values.shape), scales.view(values.shape[:-1])


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize: [..., run] int8 and [...] scales -> [..., run] in `dtype`."""
    x = q.reshape(-1, q.shape[-1]).to(dtype).mul_(scales.reshape(-1, 1).to(dtype))
    return x.view(q.shape)


class HostTier:
    def __init__(
        self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, fmt: str, pin: bool
    ) -> None:
        layers, _, *block = block_shape
        self.format = fmt
        self.dtype = dtype
        self.num_slots = num_slots
        shape = (layers, 2, num_slots, *block)
        # torch.empty: the kernel hands out pages as slots are first written.
        if fmt == "int8":
            self.data = torch.empty(shape, dtype=torch.int8)
            self.scales = torch.empty((layers, 2, num_slots))
        else:
            self.data = torch.empty(shape, dtype=dtype, pin_memory=pin)

    def store(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """blocks: [layers, 2, n, block_size, heads, head_dim], on the host or the pool's
        device, written into `slots` (n distinct)."""
        blocks = blocks.cpu()
        if self.format == "int8":
            q, scales = quantize(blocks.flatten(3))
            self.data.index_copy_(2, slots, q.view(blocks.shape))
            self.scales.index_copy_(2, slots, scales)
        else:
            copyable(self.data).index_copy_(2, slots, copyable(blocks.to(self.dtype)))

    def fetch(self, slots: torch.Tensor) -> torch.Tensor:
        """The blocks of `slots`, [layers, 2, n, block_size, heads, head_dim], in the pool's
        dtype, on the host. index_select, not indexing: on the CPU the latter's kernel is
        several times slower on these shapes."""
        data = self.data.index_select(2, slots)
        if self.format == "int8":
            return dequantize(data.flatten(3), self.scales.index_select(2, slots), self.dtype).view(
                data.shape
            )
        return data
