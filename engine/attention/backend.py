"""The one interface through which models run attention over the paged KV cache.

A backend writes a step's new K/V into the cache and computes causal attention of every query
token against its request's whole context. It owns no cache memory and must never keep
per-request state between steps: everything it needs comes from AttentionMetadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the first layer: a backend may derive per-step data
        (masks, gather indices) here and reuse it in every layer's forward."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention for one layer.

        q: [T, H, D]; k, v: [T, KVH, D] (views are fine); kv_cache: [2, num_blocks,
        block_size, KVH, D], index 0 = K, 1 = V. Writes k and v at meta.slot_mapping, then
        query token j of request i (query length q_i, context length s_i) attends to positions
        0 .. s_i - q_i + j of that request, read through meta.block_tables. Returns a new
        contiguous [T, H, D] tensor.
        """


def get_attention_backend(name: str, device: str | torch.device) -> AttentionBackend:
    """"auto" is "triton" on CUDA devices and "torch" elsewhere; "triton" off CUDA needs the
    Triton interpreter (TRITON_INTERPRET=1, tests only)."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch' or 'triton'")
