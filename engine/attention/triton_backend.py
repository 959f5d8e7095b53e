"""Attention over the paged KV cache with the Triton kernels of engine.kernels.triton: the GPU
backend. It also runs the layer's other hot ops (RMSNorm fused with the residual add, rotary
embedding, SiLU-and-mul) as single kernels.

Per layer: one launch writes the step's K/V at their slots, one runs every decode (the first
meta.num_decodes requests) and one every prefill/extend request. The kernels read lengths and
block tables from device memory, so a step never synchronizes with the host; the metadata is
copied to the cache's device once per step. It also runs on CPU tensors under the Triton
interpreter (how the test suite checks it). It must never keep per-request state between
steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.runtime.interpreter import InterpretedFunction

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kernels.triton.activation import silu_and_mul
from engine.kernels.triton.kv_cache import write_kv_cache
from engine.kernels.triton.paged_attention import (
    paged_attention_kernel,
    paged_decode_attention,
    paged_prefill_attention,
)
from engine.kernels.triton.rms_norm import rms_norm
from engine.kernels.triton.rotary import rotary_embedding_


@dataclass
class _DeviceMeta:
    meta: AttentionMetadata
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, device: str | torch.device) -> None:
        if torch.device(device).type != "cuda" and not isinstance(
            paged_attention_kernel, InterpretedFunction
        ):
            raise ValueError(
                f"attention backend 'triton' needs a CUDA device (device is {device}); on CPU use "
                "'torch' or 'auto' (the Triton interpreter, TRITON_INTERPRET=1, is for tests)"
            )
        # This step's metadata on the device, per metadata object (a hybrid model's KV groups
        # each have theirs).
        self._device_metas: dict[int, _DeviceMeta] = {}

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if x.dim() != 2:  # per-head norms (Qwen3's q/k norm) keep the torch path
            return super().rms_norm(x, weight, eps, residual)
        return rms_norm(x, weight, eps, residual)

    def rotary_(self, qk, num_q_heads, positions, table, cos_sin) -> None:
        rotary_embedding_(qk[:, :num_q_heads], qk[:, num_q_heads:], positions, table)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def prepare(self, meta: AttentionMetadata) -> None:
        # The runner may refill the same metadata object in place: never trust old copies.
        self._device_metas.clear()

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
        dm = self._device_metas.get(id(meta))
        if dm is None or dm.meta is not meta:
            dm = self._device_metas[id(meta)] = _to_device(meta, kv_cache.device)
        write_kv_cache(k, v, kv_cache, dm.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = meta.num_decodes
        if n > 0:
            paged_decode_attention(
                q[:n],
                kv_cache,
                dm.block_tables[:n],
                dm.seq_lens[:n],
                scale,
                out=out[:n],
                window=window,
                sinks=sinks,
            )
        if n < meta.num_reqs:
            # Absolute query offsets: the kernel reads and writes only the prefill rows.
            paged_prefill_attention(
                q,
                kv_cache,
                dm.query_start_loc[n:],
                dm.seq_lens[n:],
                dm.block_tables[n:],
                scale,
                meta.max_query_len,
                out=out,
                window=window,
                sinks=sinks,
            )
        return out


def _to_device(meta: AttentionMetadata, device: torch.device) -> _DeviceMeta:
    def move(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(device=device, dtype=dtype, non_blocking=True)

    return _DeviceMeta(
        meta=meta,
        slot_mapping=move(meta.slot_mapping, torch.int64),
        query_start_loc=move(meta.query_start_loc, torch.int32),
        seq_lens=move(meta.seq_lens, torch.int32),
        block_tables=move(meta.block_tables, torch.int32),
    )
