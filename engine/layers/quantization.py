"""Weight-only quantization of linear layers on the CPU: int8 per output channel, or int4 in
groups of 32 input features; the activations stay in the model's dtype. A GGUF's int8 tensors
keep their own grid: int8 with a scale per group of 32 (Q8_0's blocks, copied bit for bit) or
16 input features (Q6_K's sub-blocks), "grouped int8", on Folio's kernels only; a fused layer
whose parts come in both (a Q4_K_M GGUF's q and k in Q4_K, v in Q6_K) keeps each part in its own
layout, its product the parts' products side by side (`parts_weight`).

int4 uses the scheme of GGUF's Q4_1 (each group of 32 weights: a scale and a minimum, codes
0-15), so the default model, whose weights come from a Q4_1 GGUF, is served on exactly the 4-bit
grid it was published on. The vocabulary projection is quantized to int8 in both modes, as that
GGUF keeps its embedding in 8 bits. Folio's kernels keep the group scales and minimums in
float16 (as Q4_1 does), or in float32 for a grid float16 would round (a Q4_K GGUF's, whose
scales d * sc take up to 17 significant bits).

Two kernels multiply: Folio's AVX2 kernels (engine/kernels/cpu/cpu_quant.cpp), for float32
activations, which read the small weights once per step; and torch's weight-only kernels, made
for bfloat16 on AVX-512, which run float32 several times slower than a plain float32 matmul and
so serve the other dtypes (and CPUs the AVX2 kernels cannot run on). engine.layers.linear
chooses between them; long prefills' products dequantize and run one dense matmul. This module
only converts weights and multiplies by them; it never decides which layers are quantized (the
model does) nor which kernel a weight gets (engine.layers.linear does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.config import QUANTIZATIONS
from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.kernels.cpu.extension import INT4_GROUP_SIZE, INT4_STRIP

# The group sizes of grouped int8 weights: Q8_0's blocks and Q6_K's sub-blocks.
INT8_GROUP_SIZES = (32, 16)
GROUPED_INT8 = "grouped int8"

# Above this many rows a product dequantizes the weight and runs a dense matmul instead: the
# dequantization's fixed cost against the dense matmul's lower cost per row puts the crossover
# near here for Folio's kernels and near 16 rows for torch's (bench/quant_kernels.py --rows
# measures it; docs/quantization.md).
MAX_FOLIO_KERNEL_ROWS = 256
MAX_TORCH_KERNEL_ROWS = 16
# On CPUs that compute bfloat16 natively, an int4 weight's dense product runs in it, from a
# dequantization in one pass: Folio's int4 kernel (strips of 16 output channels) keeps up with
# it to about 128 rows (30 layers of the default model's linears, 2 threads, AVX-512 Xeon: the
# kernel 0.61x the dense product's time at 64 rows, 1.02x at 128, 1.24x at 256). Without native
# bfloat16 the dense product is float32, which the kernel outruns at any prefill size (AVX2 code
# against MKL's AVX2 sgemm: 0.58x its time at 256 rows, 0.65x at 1,024, 0.83x at 2,048).
MAX_INT4_KERNEL_ROWS = 128
MAX_INT4_FLOAT32_KERNEL_ROWS = 2048


@dataclass
class QuantizedWeight:
    """An [out, in] weight; `matmul(x)` is x @ weight.T."""

    method: str  # "int8", GROUPED_INT8 or "int4" (a PartsWeight: its parts', e.g. "int4 + ...")
    # int8 (either): [out, in] int8 codes; on Folio's kernels where the CPU has AVX-512 VNNI
    # (and out is a multiple of 16) strips of 16 output channels instead, [out / 16, in / 32,
    # 512] in grouped_int8_strip_codes' order.
    # int4: [out, in / 2] uint8, two 4-bit codes to a byte: in each group of 32 input features,
    # byte i holds feature i in its low half and feature i + 16 in its high half (GGUF Q4_1's
    # order); on Folio's kernels strips of 16 output channels instead, [out / 16, in / 32, 256]
    # in int4_strip_codes' order.
    codes: torch.Tensor
    # int8: [out] scales ([out / 16, 16] with strips); grouped int8: [out, in / 32 or in / 16]
    # scales, the weight being code * scale, float16 (Q8_0's) or float32 (Q6_K's d * sc), in
    # the strips' order [out / 16, groups, 16] where its codes are in strips; int4: [out, in /
    # 32] scales, the weight being code * scale + minimum, stored for Folio's kernels as float16
    # (Q4_1's) or, both of them, float32 (Q4_K's), and in the strips' order, [out / 16, in /
    # 32, 16].
    scale: torch.Tensor
    minimum: torch.Tensor | None
    # Folio's AVX2 ops (float32 activations), or None to use torch's kernels, for which int4
    # also keeps torch's own packing of the codes and its [in / 32, out, 2] scales and zeros.
    kernels: Any
    torch_int4: tuple[torch.Tensor, torch.Tensor] | None = None
    # Whether its long products run in bfloat16 (int4 on Folio's kernels, where the CPU
    # computes bfloat16 natively: MAX_INT4_KERNEL_ROWS); decided once, when it is made.
    dense_bf16: bool = False

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this ~120 times: a matrix skips the reshaping (a few us each).
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.shape[0] > self.max_kernel_rows:
            out = self._dense(flat)
        elif self.kernels is not None:
            out = self._folio_kernel(flat.contiguous())
        elif self.method == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale)
        else:
            assert self.torch_int4 is not None
            packed, scales_and_zeros = self.torch_int4
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, packed, INT4_GROUP_SIZE, scales_and_zeros
            )
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    @property
    def max_kernel_rows(self) -> int:
        if self.kernels is None:
            return MAX_TORCH_KERNEL_ROWS
        if self.method == "int4":
            return MAX_INT4_KERNEL_ROWS if self.dense_bf16 else MAX_INT4_FLOAT32_KERNEL_ROWS
        return MAX_FOLIO_KERNEL_ROWS

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """A long prefill's product: one dense matmul by the dequantized weight. An int4 weight
        on Folio's kernels multiplies in bfloat16 where the CPU computes it natively (twice
        float32's speed; its rounding, about 0.4% of a value, is small beside the 4-bit grid's
        own error, and the kernels round activations to 8 bits anyway)."""
        dtype = torch.bfloat16 if self.dense_bf16 else x.dtype
        return (x.to(dtype) @ self.dequantized(dtype).t()).to(x.dtype)

    def _folio_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "int8":
            return self.kernels.int8_linear(x, self.codes, self.scale)
        if self.method == GROUPED_INT8:
            return self.kernels.grouped_int8_linear(x, self.codes, self.scale)
        return self.kernels.int4_linear(x, self.codes, self.scale, self.minimum)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out, in] this one stands for."""
        if self.method == "int8":
            codes = _unstrip(self.codes) if self.codes.dim() == 3 else self.codes
            return codes.to(dtype) * self.scale.to(dtype).view(-1, 1)
        if self.method == GROUPED_INT8:
            every = torch.arange(self.shape[0])
            return self.kernels.grouped_int8_lookup(every, self.codes, self.scale).to(dtype)
        assert self.minimum is not None
        if self.kernels is not None:
            native = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
            weight = self.kernels.int4_dequantize(self.codes, self.scale, self.minimum, native)
            return weight.to(dtype)
        out_features = self.codes.shape[0]
        packed = self.codes.view(out_features, -1, INT4_GROUP_SIZE // 2)
        groups = torch.cat((packed & 0xF, packed >> 4), dim=-1).to(dtype)
        weight = torch.addcmul(
            self.minimum.to(dtype)[..., None], groups, self.scale.to(dtype)[..., None]
        )
        return weight.view(out_features, -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the float32 weight (an embedding lookup: [*ids.shape, in]), of a
        grouped int8 weight: only those rows are dequantized, exactly (code * scale: at most
        18 significant bits for Q8_0's, 23 for Q6_K's), by one opaque op
        (folio_quant::grouped_int8_lookup: a compiled program reads them from a buffer)."""
        if self.method != GROUPED_INT8:
            raise ValueError(f"rows are looked up in grouped int8 weights, not {self.method}")
        return self.kernels.grouped_int8_lookup(ids, self.codes, self.scale)

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the float weight this one stands for."""
        if self.codes.dim() == 3:  # strips of 16 channels (int4, grouped int8)
            return self.codes.shape[0] * INT4_STRIP, self.codes.shape[1] * INT4_GROUP_SIZE
        in_features = self.codes.shape[1] * (2 if self.method == "int4" else 1)
        return self.codes.shape[0], in_features


@dataclass
class PartsWeight(QuantizedWeight):
    """A fused layer's weight (q, k and v; gate and up) whose parts keep different layouts on
    Folio's kernels, int4 and grouped int8 (a Q4_K_M GGUF's q and k in Q4_K, v in Q6_K; runs of
    parts in one layout are one part here), none rounded to another's grid: x @ weight.T is the
    parts' products side by side. Up to every part's row limit one parts_linear call writes them
    into one output (each part's product exactly its own kernel's: no per-part outputs to
    concatenate); beyond it each part takes its own path (a long prefill's dense products).
    `codes` and `scale` are empty: the parts hold the weights."""

    parts: tuple[QuantizedWeight, ...] = ()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.shape[0] > self.max_kernel_rows:
            out = torch.cat([part.matmul(flat) for part in self.parts], dim=-1)
        else:
            parts = self.parts
            out = self.kernels.parts_linear(
                flat.contiguous(),
                [p.codes for p in parts],
                [p.scale for p in parts],
                [p.minimum for p in parts],
            )
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    @property
    def max_kernel_rows(self) -> int:
        return min(part.max_kernel_rows for part in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([part.dequantized(dtype) for part in self.parts])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"rows are looked up in grouped int8 weights, not {self.method}")


def parts_weight(parts: list[QuantizedWeight]) -> PartsWeight:
    """The fused weight of `parts` (in the layer's order), each int4 or grouped int8 on Folio's
    kernels, of the same input features."""
    kinds = [part.method for part in parts]
    if not parts or any(kind not in ("int4", GROUPED_INT8) for kind in kinds):
        raise ValueError(f"a parts weight takes int4 and grouped int8 parts, got {kinds}")
    if any(part.kernels is None for part in parts):
        raise ValueError("a parts weight runs on Folio's kernels only; a part is on torch's")
    widths = {part.shape[1] for part in parts}
    if len(widths) != 1:
        raise ValueError(f"a parts weight's parts take the same input features, got {widths}")
    method = " + ".join(dict.fromkeys(kinds))
    empty = torch.empty(0, dtype=torch.int8)
    return PartsWeight(method, empty, empty, None, torch.ops.folio_quant, parts=tuple(parts))


def grouped_int8_weight(
    codes: torch.Tensor, scale: torch.Tensor, strips: bool | None = None
) -> QuantizedWeight:
    """An int8 weight with a scale per group of input features, w = code * scale: codes
    [out, in] int8 and scales [out, in / 32] float16 (a Q8_0 GGUF tensor's, kept as they are)
    or [out, in / 16] float32 (a Q6_K tensor's d * sc, exact in float32), for float32
    activations on Folio's kernels, which the caller has checked loaded
    (engine.layers.linear.folio_quant_kernels); the input features a multiple of 32.

    `strips`: kept in strips of 16 output channels (grouped_int8_strip_codes; out a multiple of
    16), whose widened codes the rows of a verification step or a batch share: on an AVX-512
    VNNI EPYC 1.7x a row-major pass's speed at one row, 2.6x at five, 3.4x at sixteen (docs/
    quantization.md). None (the default): strips where the CPU has AVX-512 VNNI and out allows;
    AVX2-only CPUs keep the row-major layout, which a layout like the strips' did not beat at one
    and two rows on an AVX2 EPYC (Zen 3)."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(
            f"grouped int8 codes are an int8 matrix, got {codes.dtype} of shape "
            f"{tuple(codes.shape)}"
        )
    if scale.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"grouped int8 scales are float16 or float32, not {scale.dtype}")
    out_features, in_features = codes.shape
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(
            f"grouped int8 needs input features divisible by {INT4_GROUP_SIZE}; a weight has "
            f"{in_features}"
        )
    sizes = {in_features // size: size for size in INT8_GROUP_SIZES}
    if scale.dim() != 2 or scale.shape[0] != out_features or scale.shape[1] not in sizes:
        raise ValueError(
            f"grouped int8 scales for a [{out_features}, {in_features}] weight are one per "
            f"{' or '.join(map(str, INT8_GROUP_SIZES))} features, [{out_features}, "
            f"{' or '.join(map(str, sizes))}]; got {tuple(scale.shape)}"
        )
    if strips is None:
        strips = cpu_capabilities().avx512_vnni and out_features % INT4_STRIP == 0
    if strips:
        if out_features % INT4_STRIP:
            raise ValueError(
                f"grouped int8 strips need output features divisible by {INT4_STRIP}; a weight "
                f"has {out_features}"
            )
        codes, scale = grouped_int8_strip_codes(codes), strip_groups(scale)
    return QuantizedWeight(
        GROUPED_INT8, codes.contiguous(), scale.contiguous(), None, torch.ops.folio_quant
    )


def grouped_int8_strip_codes(codes: torch.Tensor) -> torch.Tensor:
    """Grouped int8 codes [out, in] (out a multiple of 16, in of 32) in strips of 16 output
    channels, [out / 16, in / 32, 512], a lossless permutation: byte 32 p + 2 c + i of a strip's
    block holds channel c's code at position 2 p + i of the block, so that 32 bytes widened to
    int16 are the 16 channels' codes at two positions, a 32-bit lane to a channel (each
    channel's products then sum in its own lane, with no sums across lanes)."""
    out_features, in_features = codes.shape
    blocks = in_features // INT4_GROUP_SIZE
    strips = codes.view(out_features // INT4_STRIP, INT4_STRIP, blocks, INT4_GROUP_SIZE // 2, 2)
    return strips.permute(0, 2, 3, 1, 4).reshape(out_features // INT4_STRIP, blocks, -1)


def check_quantizable(method: str, weight: torch.Tensor) -> None:
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if weight.device.type != "cpu":
        raise ValueError(f"weight-only quantization runs on the CPU only, not {weight.device}")
    if method == "int4" and weight.shape[1] % INT4_GROUP_SIZE:
        raise ValueError(
            f"int4 needs input features divisible by {INT4_GROUP_SIZE}; a weight has "
            f"{weight.shape[1]}"
        )


def quantize(
    weight: torch.Tensor, method: str, folio_kernels: bool, strips: bool | None = None
) -> QuantizedWeight:
    """The weight [out, in] quantized, multiplied by Folio's kernels (float32 activations, and
    only where they loaded: engine.layers.linear.pack_weight chooses) or else by torch's.
    `strips`: int8 on Folio's kernels in strips of 16 output channels, as grouped_int8_weight
    keeps them (None: where the CPU has AVX-512 VNNI and out is a multiple of 16, in of 32)."""
    check_quantizable(method, weight)
    kernels = torch.ops.folio_quant if folio_kernels else None
    # Scales in the activations' dtype for torch's kernels; for Folio's, float32 (int8) and
    # float16 (int4, whose per-group scales and minimums would otherwise be a third of the bytes
    # its kernel reads).
    w = weight.detach().float()
    if method == "int8":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        if kernels is None:
            return QuantizedWeight("int8", codes, scale.to(weight.dtype), None, None)
        out_features, in_features = codes.shape
        fits = out_features % INT4_STRIP == 0 and in_features % INT4_GROUP_SIZE == 0
        if strips is None:
            strips = fits and cpu_capabilities().avx512_vnni
        if strips:
            if not fits:
                raise ValueError(
                    f"int8 strips need output features divisible by {INT4_STRIP} and input "
                    f"features by {INT4_GROUP_SIZE}; a weight is {out_features}x{in_features}"
                )
            codes, scale = grouped_int8_strip_codes(codes), scale.view(-1, INT4_STRIP)
        return QuantizedWeight("int8", codes, scale.contiguous(), None, kernels)
    groups = w.view(w.shape[0], -1, INT4_GROUP_SIZE)
    # Scale and minimum on the float16 grid first, the codes then chosen for those values.
    low = groups.amin(dim=-1).half().float()
    scale = ((groups.amax(dim=-1) - low) / 15).half().float()
    codes = torch.round((groups - low[..., None]) / scale.clamp(min=1e-12)[..., None]).clamp(0, 15)
    halves = codes.to(torch.uint8).view(w.shape[0], -1, 2, INT4_GROUP_SIZE // 2)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(w.shape[0], -1)
    return int4_weight(nibbles, scale, low, weight.dtype, folio_kernels)


def int4_strip_codes(nibbles: torch.Tensor) -> torch.Tensor:
    """Int4 codes in Q4_1's order ([out, in / 2] uint8, or [out, in / 32, 16] with rows and
    groups at any stride: a GGUF tensor's blocks read in place; out a multiple of 16) in the
    order Folio's kernels read them, a lossless permutation: strips of 16 output channels,
    [out / 16, in / 32, 256], byte 64 u + 4 c + i of a strip's group holding channel c's code at
    position 8 u + i in its low half and 8 u + 4 + i in its high half (a 64-byte load splits
    into positions 8 u .. 8 u + 4 and 8 u + 4 .. 8 u + 8 of the 16 channels, a 32-bit lane to a
    channel: each channel's products then sum in its own lane, with no sums across lanes). One
    pass in Folio's kernels (cpu_quant.cpp), which alone read this order."""
    groups = nibbles if nibbles.dim() == 3 else nibbles.unflatten(1, (-1, INT4_GROUP_SIZE // 2))
    return torch.ops.folio_quant.int4_strip_codes(groups)


def _unstrip(strips: torch.Tensor) -> torch.Tensor:
    """grouped_int8_strip_codes undone: strips [out / 16, in / 32, 512] -> codes [out, in]."""
    count, blocks = strips.shape[:2]
    codes = strips.view(count, blocks, INT4_GROUP_SIZE // 2, INT4_STRIP, 2).permute(0, 3, 1, 2, 4)
    return codes.reshape(count * INT4_STRIP, blocks * INT4_GROUP_SIZE)


def strip_groups(values: torch.Tensor) -> torch.Tensor:
    """Per-group values [out, groups] (int4 scales or minimums, grouped int8 scales) in the
    strips' order, [out / 16, groups, 16]."""
    out_features, groups = values.shape
    strips = values.reshape(out_features // INT4_STRIP, INT4_STRIP, groups)
    return strips.transpose(1, 2).contiguous()


def int4_weight(
    nibbles: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    dtype: torch.dtype,
    folio_kernels: bool,
    group_dtype: torch.dtype = torch.float16,
) -> QuantizedWeight:
    """An int4 weight from its codes ([out, in / 2] uint8, packed as QuantizedWeight.codes says,
    or [out, in / 32, 16] as int4_strip_codes takes them; out a multiple of 16) and its
    per-group scales and minimums ([out, in / 32], values of `group_dtype`: float16, or float32
    where float16 would round them), for activations of `dtype`: what `quantize` computes, or
    what a Q4_0/Q4_1/Q4_K GGUF tensor holds. Folio's kernels keep them in `group_dtype` (in the
    strips' order); torch's take them in `dtype`."""
    if group_dtype not in (torch.float16, torch.float32):
        raise ValueError(f"int4 group scales are float16 or float32, not {group_dtype}")
    out_features = nibbles.shape[0]
    if out_features % INT4_STRIP:
        kernel = "Folio's kernel" if folio_kernels else "torch's kernel"
        raise ValueError(
            f"int4 on {dtype} ({kernel}) needs output features divisible by {INT4_STRIP}; a "
            f"weight has {out_features}"
        )
    kernels = torch.ops.folio_quant if folio_kernels else None
    if kernels is not None:
        quantized = QuantizedWeight(
            "int4",
            int4_strip_codes(nibbles),
            strip_groups(scale.to(group_dtype)),
            strip_groups(minimum.to(group_dtype)),
            kernels,
            dense_bf16=cpu_capabilities().native_bf16,
        )
    else:
        quantized = QuantizedWeight(
            "int4", nibbles.reshape(out_features, -1), scale.to(dtype), minimum.to(dtype), None
        )
        packed = nibbles.view(out_features, -1, INT4_GROUP_SIZE // 2)
        codes = torch.cat((packed & 0xF, packed >> 4), dim=-1).to(torch.int32)
        scale, minimum = scale.float(), minimum.float()
        # torch's kernel reads a code c as (c - 8) * scale + zero: the zero point sits 8 steps
        # above the group's minimum.
        zero = minimum + 8 * scale
        scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(out_features, -1), 1)
        quantized.torch_int4 = (packed, scales_and_zeros.to(dtype))
    return quantized
