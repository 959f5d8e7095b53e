"""The host tier's storage: a bounded array of block slots in host memory.

Two formats. `native`: the pool's dtype as it is (pinned memory on CUDA, so copies to and from
the device are DMA). `int8`: on the CPU, where the pool already is host memory, the tier is only
worth having if it holds more than the pool would: K and V are quantized to 8 bits with one
symmetric float32 scale per block, layer and K|V (absmax / 127 over the block's tokens, heads
and head dimension), about a quarter of float32's bytes and half of bfloat16's. The error is
at most half a step of that scale per value (docs/kv_tiers.md gives measured figures).

A slot holds one block of every layer: [layers, 2 (K, V), block_size, kv_heads, head_dim]. This
module stores and returns tensors by slot; which slot holds what is engine.kv_tiers.book's.
"""

from __future__ import annotations

import torch

FORMATS = ("auto", "int8", "native")


def resolve_format(fmt: str, device: torch.device) -> str:
    """auto: int8 on the CPU, native (pinned host memory) on a GPU."""
    if fmt == "auto":
        return "int8" if device.type == "cpu" else "native"
    return fmt


def bytes_per_block(block_shape: tuple[int, ...], dtype: torch.dtype, fmt: str) -> int:
    layers, _, block_size, heads, head_dim = block_shape
    values = layers * 2 * block_size * heads * head_dim
    if fmt == "int8":
        return values + layers * 2 * 4  # and the float32 scales
    return values * torch.empty((), dtype=dtype).element_size()


def quantize(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, layers, 2, block_size, heads, head_dim] -> int8 values and [n, layers, 2] float32
    scales (each a contiguous run of block_size * heads * head_dim values: one pass)."""
    n, layers = blocks.shape[:2]
    x = blocks.reshape(n * layers * 2, -1).to(torch.float32, copy=True)  # divided in place
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, keepdim=True)
    scales = amax.clamp_min_(1e-12).div_(127.0)
    # |x / scale| <= 127 by construction: no clamp needed.
    q = x.div_(scales).round_().to(torch.int8)
    return q.view(blocks.shape), scales.view(n, layers, 2)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, layers = q.shape[:2]
    x = q.reshape(n * layers * 2, -1).to(dtype).mul_(scales.view(-1, 1).to(dtype))
    return x.view(q.shape)


class HostTier:
    def __init__(
        self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, fmt: str, pin: bool
    ) -> None:
        self.format = fmt
        self.dtype = dtype
        # torch.empty: the kernel hands out pages as slots are first written.
        if fmt == "int8":
            self.data = torch.empty((num_slots, *block_shape), dtype=torch.int8)
            self.scales = torch.empty((num_slots, block_shape[0], 2))
        else:
            self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)

    def store(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """blocks: [n, *block_shape] on the host, written into `slots` (distinct)."""
        if self.format == "int8":
            q, scales = quantize(blocks)
            self.data.index_copy_(0, slots, q)
            self.scales.index_copy_(0, slots, scales)
        else:
            self.data.index_copy_(0, slots, blocks.to(self.dtype))

    def fetch(self, slots: torch.Tensor) -> torch.Tensor:
        """The blocks of `slots`, [n, *block_shape], in the pool's dtype, on the host."""
        if self.format == "int8":
            return dequantize(self.data[slots], self.scales[slots], self.dtype)
        return self.data[slots]
