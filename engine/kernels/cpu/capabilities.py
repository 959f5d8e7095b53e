"""What this CPU and Folio's CPU kernels can do, probed once per process: the one object every
CPU fast-path choice reads (which linear kernel, whose paged attention, which dtype "auto" is).

Probing loads Folio's kernels (engine.kernels.cpu.extension: a build on the first run on a
machine), so callers probe only once they know they run on the CPU. This module only answers;
it never chooses a kernel (engine.layers.linear, the torch attention backend and the model
runner's dtype choice do).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.kernels.cpu import extension


@dataclass(frozen=True)
class CpuCapabilities:
    # AVX2 and FMA: what Folio's kernels need at the least.
    avx2_fma: bool
    # Folio's kernels built and loaded (torch.ops.folio_quant, folio_cpu_attention,
    # folio_linear): False without AVX2, without a C++ compiler, or after a build error.
    folio_kernels: bool
    # AVX-512 BF16 dot products, asked of Folio's kernels (False where they did not load).
    avx512_bf16: bool
    # torch computes bfloat16 natively here (oneDNN); elsewhere it is emulated, far slower.
    native_bf16: bool
    # oneDNN can reorder a weight into its prepacked layout for linears.
    onednn_packing: bool

    @property
    def packed_float32(self) -> bool:
        """float32 linears over oneDNN-packed weights, through Folio's packed_linear op."""
        return self.onednn_packing and self.folio_kernels

    @property
    def bf16_tiles(self) -> bool:
        """bfloat16 linears over Folio's own tiles (bf16_linear)."""
        return self.folio_kernels and self.avx512_bf16


@functools.cache
def cpu_capabilities() -> CpuCapabilities:
    loaded = extension.load()
    return CpuCapabilities(
        avx2_fma=extension.cpu_has_avx2(),
        folio_kernels=loaded,
        avx512_bf16=loaded and bool(torch.ops.folio_linear.cpu_has_avx512_bf16()),
        native_bf16=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        onednn_packing=torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"),
    )
