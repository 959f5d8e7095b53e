"""MXFP4 (the OCP microscaling format gpt-oss's checkpoints store their experts in) dequantized:
blocks of 32 FP4 (E2M1) values, two to a byte with the first value in the low nibble, each
block scaled by 2 ** (e - 127) for its uint8 exponent e (E8M0).

A checkpoint writes a weight [rows, cols] as `*_blocks` [..., rows, cols / 32, 16] uint8 and
`*_scales` [..., rows, cols / 32] uint8. Folio has no FP4 kernel, so the loader dequantizes
them to the model's dtype once, at load; every value is exact in bfloat16 and float32 (a
3-bit mantissa at most, times a power of two). This module only converts tensors: it never
reads files.
"""

from __future__ import annotations

import torch

# E2M1's 16 codes: sign bit, then two exponent bits and one mantissa bit.
_FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[..., rows, groups, 16] uint8 blocks and [..., rows, groups] uint8 exponents ->
    [..., rows, groups * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(blocks [..., groups, 16], scales [..., groups])"
        )
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = torch.stack((table[(blocks & 0x0F).int()], table[(blocks >> 4).int()]), dim=-1)
    values = values.flatten(-2)  # [..., groups, 32], low nibble first
    exponents = scales.int() - 127
    out = torch.ldexp(values, exponents[..., None].float())
    return out.flatten(-2).to(dtype)
