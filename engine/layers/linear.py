"""Linear layers, and the one place that chooses how a weight is multiplied: `pack_weight`.

Once loaded, each weight gets one form, from the CPU's capabilities (engine.kernels.cpu.
capabilities, probed once): dense (torch's F.linear: on GPUs, and wherever nothing faster runs),
oneDNN's prepacked layout through Folio's packed_linear op (float32 on the CPU), Folio's bfloat16
tiles through bf16_linear (bfloat16 on CPUs with AVX-512 BF16), or int8/int4 codes (weight-only
quantization, engine.layers.quantization) multiplied by Folio's kernels or torch's. The
tensor-parallel forms are here too: column-parallel layers hold a share of the output rows,
row-parallel ones a share of the input columns and all-reduce their partial products
(engine.layers.parallel says which share). This module never reads files and never decides
which layers are quantized (the model does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu.capabilities import CpuCapabilities, cpu_capabilities
from engine.layers.parallel import CheckpointSlice, TensorParallel, all_reduce_
from engine.layers.quantization import QuantizedWeight, quantize


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """A frozen parameter with no values yet: only the loader fills it."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


@dataclass
class Bf16Tiles:
    """A bfloat16 weight [out_features, in] in the tiles of Folio's bf16_linear op
    (engine/kernels/cpu/cpu_linear.cpp: AVX-512 BF16 dot products), or with `widened` of its
    widened_bf16_linear op (float32 activations, each weight widened to float32 in registers:
    AVX2)."""

    tiles: torch.Tensor
    out_features: int
    widened: bool = False

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.widened:
            return torch.ops.folio_linear.widened_bf16_linear(
                x, self.tiles, bias, self.out_features
            )
        return torch.ops.folio_linear.bf16_linear(x, self.tiles, bias, self.out_features)


PackedWeight = torch.Tensor | Bf16Tiles | QuantizedWeight


def pack_weight(
    weight: torch.Tensor,
    quantization: str | None = None,
    capabilities: CpuCapabilities | None = None,
) -> PackedWeight | None:
    """The weight in the form its fastest kernel reads, or None for F.linear on the weight as it
    is. `capabilities` defaults to this CPU's, probed only for CPU weights.

    - int8/int4 (`quantization`): Folio's kernels for float32 weights (so activations) where
      they loaded, torch's otherwise.
    - bfloat16: Folio's tiles on CPUs with AVX-512 BF16, for an even number of input features
      (elsewhere bfloat16 is not the default dtype: it is emulated there). Measured against
      oneDNN's bfloat16 kernels on its prepacked weights, never slower at any batch size served
      (docs/quantization.md, "bfloat16 on the CPU").
    - float32 holding bfloat16 values (a bfloat16 checkpoint's weights), on CPUs without
      AVX-512 BF16: stored in bfloat16, in the same tiles, for Folio's AVX2 widened_bf16_linear
      (float32 products of exactly these values, reading half float32's bytes).
    - other float32: oneDNN's prepacked layout through Folio's packed_linear op, which compiled
      decode programs can call. torch's F.linear calls MKL, whose small-batch sgemm runs far below
      these CPUs' bandwidth (docs/quantization.md); results differ from MKL's by float32
      rounding (summation order) only.
    """
    on_cpu = weight.device.type == "cpu"
    if quantization is not None:
        folio = folio_quant_kernels(weight.dtype, weight.device, capabilities)
        return quantize(weight, quantization, folio_kernels=folio)
    if not on_cpu:
        return None
    caps = _capabilities(capabilities)
    even = weight.shape[-1] % 2 == 0
    if weight.dtype == torch.bfloat16 and even and caps.bf16_tiles:
        return Bf16Tiles(torch.ops.folio_linear.pack_bf16_weight(weight), weight.shape[0])
    if weight.dtype == torch.float32 and even and caps.widened_bf16 and holds_bf16(weight):
        tiles = torch.ops.folio_linear.pack_bf16_weight(weight.bfloat16())
        return Bf16Tiles(tiles, weight.shape[0], widened=True)
    if weight.dtype == torch.float32 and caps.packed_float32:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return None


def holds_bf16(weight: torch.Tensor) -> bool:
    """Whether every float32 value is a bfloat16 one (its low 16 bits zero), so that bfloat16
    stores it exactly."""
    return not bool((weight.view(torch.int32) & 0xFFFF).any())


def kernel_name(packed: PackedWeight | None) -> str:
    """Which kernel multiplies a weight in this form, in words."""
    if isinstance(packed, Bf16Tiles):
        if packed.widened:
            return "bfloat16 weights widened to float32 (AVX2)"
        return "bfloat16 tiles (AVX-512 BF16)"
    if isinstance(packed, QuantizedWeight):
        return f"{packed.method} ({'Folio' if packed.kernels else 'torch'})"
    return "float32 oneDNN-packed" if packed is not None else "torch F.linear"


def describe_linears(model: nn.Module) -> str:
    """How the model's linears (and its packed vocabulary projection) are multiplied, counted:
    the log line that says which kernels the CPU's capabilities and the dtype chose."""
    names = [m.kernel_description() for m in model.modules() if isinstance(m, Linear)]
    names.append(kernel_name(getattr(model, "lm_head_packed", None)))
    return ", ".join(f"{names.count(name)} {name}" for name in dict.fromkeys(names))


def folio_quant_kernels(
    dtype: torch.dtype, device: torch.device, capabilities: CpuCapabilities | None = None
) -> bool:
    """Whether a quantized weight of this dtype and device is multiplied by Folio's kernels
    (float32 on the CPU, where they loaded) rather than torch's."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and _capabilities(capabilities).folio_kernels
    )


def _capabilities(given: CpuCapabilities | None) -> CpuCapabilities:
    return cpu_capabilities() if given is None else given


def bound_cpu_kernel_caches(capacity: int) -> None:
    """Cap oneDNN's kernel caches (engine.models.loader.CPU_KERNEL_CACHE_CAPACITY says why).

    Both read their capacity from the environment when they first build a kernel, so this must
    run before the first bf16 matmul of the process; values already set are kept.
    """
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: PackedWeight | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias), through the weight's packed form where it has one."""
    if isinstance(packed, QuantizedWeight):
        out = packed.matmul(x)
        return out if bias is None else out.add_(bias)
    if isinstance(packed, Bf16Tiles):
        return packed.matmul(x, bias)
    if packed is not None:
        return torch.ops.folio_linear.packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """Weight [sum(output_sizes), in] and optional bias; output_sizes > 1 entry means fused
    shards. A column-parallel one holds checkpoint_rows of each shard (None: all rows)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        checkpoint_rows: list[CheckpointSlice] | None = None,
    ) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.checkpoint_rows = checkpoint_rows
        self.weight = empty_parameter(sum(output_sizes), in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(sum(output_sizes), dtype=dtype, device=device) if bias else None
        self.packed: PackedWeight | None = None

    def kernel_description(self) -> str:
        """Which kernel multiplies this layer's weight, in words (the load log counts them)."""
        return kernel_name(self.packed)

    def finalize_weights(self, quantization: str | None = None) -> None:
        if isinstance(self.packed, QuantizedWeight):
            return  # quantized in the checkpoint (a GGUF's Q4_0/Q4_1): kept as it came
        self.packed = pack_weight(self.weight, quantization or None)
        if self.packed is not None:
            # The packed copy is the only one the forward reads; don't hold the weights twice.
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


class RowParallelLinear(Linear):
    """Holds checkpoint_columns of the input features: each rank's product is partial and an
    all-reduce sums them; the bias (whole on every rank) is added once, after the sum."""

    def __init__(
        self,
        columns: CheckpointSlice,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel,
    ) -> None:
        super().__init__(columns.count, [out_features], False, dtype, device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.checkpoint_columns = columns
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(linear(x, self.weight, self.packed))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `partial` product (this rank's, anything added to it
        included), plus the bias."""
        out = all_reduce_(partial, self.tp)
        return out if self.bias is None else out.add_(self.bias)


def column_linear(
    in_features: int,
    shards: list[CheckpointSlice],
    bias: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallel,
    layer: type[Linear] = Linear,
) -> Linear:
    """A linear layer (of class `layer`) over the given output shards (fused when more than
    one); with several ranks it holds only this rank's rows of each."""
    sizes = [s.count for s in shards]
    return layer(in_features, sizes, bias, dtype, device, shards if tp.size > 1 else None)


def row_linear(
    columns: CheckpointSlice,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallel,
) -> Linear:
    """A linear layer over the given input features: plain with one rank, row-parallel (this
    rank's columns, all-reduced) with several."""
    if tp.size == 1:
        return Linear(columns.full, [out_features], bias, dtype, device)
    return RowParallelLinear(columns, out_features, bias, dtype, device, tp)
