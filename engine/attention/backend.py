"""The one interface through which models run attention over the paged KV cache and the
other hot ops of a layer (RMSNorm with fused residual add, rotary embedding, SiLU-and-mul,
GeLU-and-mul, gpt-oss's clamped SwiGLU).

A backend writes a step's new K/V into the cache and computes causal attention of every query
token against its request's whole context. The hot ops have plain torch implementations here
(the CPU path, and the exact one the float32 oracle checks); the Triton backend overrides them
with fused kernels. It also copies whole KV blocks for copy-on-write (the torch and Triton
backends share the plain torch version here). A backend owns no cache memory and must never
keep per-request state between steps: everything it needs comes from AttentionMetadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers does it: normalise in float32, cast back, then scale in the model dtype.
    In float32 there is nothing to cast, and torch's own rms_norm computes the same values in
    one call instead of six (bit for bit on the shapes tested)."""
    if x.dtype == weight.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var.add_(eps))).to(x.dtype)


class AttentionBackend(ABC):
    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm of x, or with a residual: residual += x in place, then RMSNorm of the sum."""
        if residual is not None:
            x = residual.add_(x)
        return torch_rms_norm(x, weight, eps)

    def rotary_(
        self,
        qk: torch.Tensor,
        num_q_heads: int,
        positions: torch.Tensor,
        table: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Rotates q = qk[:, :num_q_heads] and k = qk[:, num_q_heads:] ([T, heads, D]) in place.

        table is [max_positions, 2, D] (cos, sin with its first half negated); cos_sin is
        table[positions] split, gathered once per step by the model for backends that use it.
        """
        cos, signed_sin = cos_sin
        half = qk.shape[-1] // 2
        swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        qk.mul_(cos).addcmul_(swapped, signed_sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(gate) * up, [T, I]."""
        size = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :size]).mul_(gate_up[:, size:])

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> gelu(gate, tanh approximation) * up, [T, I] (Gemma's MLP)."""
        size = gate_up.shape[1] // 2
        return F.gelu(gate_up[:, :size], approximate="tanh").mul_(gate_up[:, size:])

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """[T, 2I] -> gpt-oss's SwiGLU, [T, I]: the gate clamped above at `limit`, up within
        +-limit, then (up + 1) * gate * sigmoid(alpha * gate)."""
        size = gate_up.shape[1] // 2
        gate = gate_up[:, :size].clamp(max=limit)
        up = gate_up[:, size:].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def copy_blocks(
        self, kv_caches: list[torch.Tensor], sources: torch.Tensor, dests: torch.Tensor
    ) -> None:
        """Copy-on-write: in every layer's cache, block dests[i] becomes a copy of block
        sources[i] (K and V). Every source is read before any destination is written, so a
        block may be both. One gather and one scatter per layer, in plain torch on any device:
        a handful of blocks per step is not worth a kernel of its own."""
        for kv_cache in kv_caches:
            kv_cache[:, dests] = kv_cache[:, sources]

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the first layer: a backend may derive per-step data
        (masks, gather indices) here and reuse it in every layer's forward. Does nothing by
        default."""
        return None

    def decode_step_op(self, q: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """An op (q, k, v, layer, scale, window, sinks) -> out (window 0: none; sinks as in
        `forward`, or None) that a compiled decode-only program may call for a layer's attention
        instead of going through Python, reading the caches and tables that `bound_decode_step`
        binds around the program; None (the default) where the backend has none for queries
        like q."""
        return None

    def bound_decode_step(
        self, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
    ) -> AbstractContextManager[None]:
        """Binds a decode-only step for decode_step_op's calls while a compiled program runs."""
        return nullcontext()

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for one layer.

        q: [T, H, D]; k, v: [T, KVH, D] (views are fine); kv_cache: [2, num_blocks,
        block_size, KVH, D], index 0 = K, 1 = V. Writes k and v at meta.slot_mapping, then
        query token j of request i (query length q_i, context length s_i) attends to positions
        0 .. p = s_i - q_i + j of that request, read through meta.block_tables; with a sliding
        `window`, to positions p - window + 1 .. p only (table entries before those may name
        blocks the request no longer holds: they are never read). With `sinks` ([H], gpt-oss's
        attention sinks) each head's softmax has one more logit, sinks[h], in its denominator
        and nothing in its sum of values. Returns a new contiguous [T, H, D] tensor.
        """
