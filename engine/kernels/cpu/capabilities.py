"""What this CPU and Folio's CPU kernels can do, probed once per process: the one object every
CPU fast-path choice reads (which linear kernel, whose paged attention, which dtype "auto" is).

Probing loads Folio's kernels (engine.kernels.cpu.extension: a build on the first run on a
machine), so callers probe only once they know they run on the CPU. FOLIO_CPU_ISA=avx2 makes the
probe answer as on an AVX2-only CPU (no AVX-512 BF16, no native bfloat16), so that the AVX2
paths are chosen on a machine that has more, for tests and benchmarks; unset (or "native"), it
answers for this CPU. This module only answers; it never chooses a kernel (engine.layers.linear,
the torch attention backend and the model runner's dtype choice do).
"""

from __future__ import annotations

import functools
import os
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
    # AVX-512 VNNI (with BW and VL): Folio's integer kernels' 512-bit code, where grouped int8
    # weights are kept in strips (engine.layers.quantization.grouped_int8_weight).
    avx512_vnni: bool
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

    @property
    def widened_bf16(self) -> bool:
        """float32 linears over bfloat16-stored weights, widened in registers by Folio's AVX2
        kernel (widened_bf16_linear): where there are no bf16 tiles (with them, "auto" is
        bfloat16 and float32 keeps oneDNN's AVX-512 kernels)."""
        return self.folio_kernels and not self.avx512_bf16


ISA_ENV = "FOLIO_CPU_ISA"
ISA_CHOICES = ("native", "avx2")


def forced_isa() -> str:
    """FOLIO_CPU_ISA's value: "native" (also when unset) or "avx2"."""
    value = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if value not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_CHOICES)}, got {value!r}")
    return value


@functools.cache
def cpu_capabilities() -> CpuCapabilities:
    native = forced_isa() == "native"
    loaded = extension.load()
    return CpuCapabilities(
        avx2_fma=extension.cpu_has_avx2(),
        folio_kernels=loaded,
        avx512_bf16=native and loaded and bool(torch.ops.folio_linear.cpu_has_avx512_bf16()),
        avx512_vnni=native and loaded and bool(torch.ops.folio_quant.cpu_has_avx512_vnni()),
        native_bf16=native and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        onednn_packing=torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"),
    )
