"""The attention front: the one way a model runs attention and the one place an attention
backend is chosen, whatever the backend (torch on the CPU, Triton on GPUs).

`Attention` is a layer's attention over its KV cache in the running step (engine.attention.step
binds the step's metadata and caches around the forward, and routes a compiled program's calls
to the backend's own op); `get_attention_backend` picks the backend a model is built with.
This module never computes attention and never holds per-step state: the backends do.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.step import attention
from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.linear import empty_parameter
from engine.layers.parallel import CheckpointSlice


class Attention(nn.Module):
    """Layer `layer_index`'s causal attention: q [T, H, D], k and v [T, KVH, D] -> [T, H, D];
    writes k and v into that layer's KV cache first. With a sliding `window` a token attends
    to its last `window` positions only, itself included (transformers' sliding_window). With
    `sink_heads` (gpt-oss), a `sinks` weight holds one attention-sink logit for each of those
    query heads (this rank's slice of the checkpoint's)."""

    def __init__(
        self,
        backend: AttentionBackend,
        layer_index: int,
        scale: float,
        window: int | None = None,
        sink_heads: CheckpointSlice | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        # Which of the step's KV caches is this layer's.
        self.layer_index = layer_index
        self.scale = scale
        self.window = window
        self.sinks = None
        if sink_heads is not None:
            assert dtype is not None and device is not None, "sinks need a dtype and a device"
            self.sinks = empty_parameter(sink_heads.count, dtype=dtype, device=device)
            # The loader reads only this rank's heads.
            self.checkpoint_rows = [sink_heads] if sink_heads.count != sink_heads.full else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(
            self.backend, q, k, v, self.layer_index, self.scale, self.window, self.sinks
        )


def get_attention_backend(name: str, device: str | torch.device) -> AttentionBackend:
    """ "auto" is "triton" on CUDA devices and "torch" elsewhere; "triton" off CUDA needs the
    Triton interpreter (TRITON_INTERPRET=1, tests only)."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        # Imported when chosen: importing Triton's kernels binds them to the interpreter or the
        # GPU compiler for the life of the process.
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch' or 'triton'")
