"""GGUF block types Folio reads as floats, dequantized in torch: Q5_0 and Q5_1 (blocks of 32)
and the K-quants Q4_K, Q5_K and Q6_K (super-blocks of 256), as ggml defines them; and Q4_K's
groups of 32 as codes, scales and minimums, for Folio's int4 layout, and Q6_K's groups of 16 as
int8 codes and scales, for Folio's grouped int8 layout.

Q5's codes take 5 bits, more than Folio's int4, and they have a minimum, which Folio's grouped
int8 has not: these are dequantized once, at load, exactly: every product here has at most 24
significant bits (float32 holds it), and a minimum is subtracted in one rounding, as ggml does.
Q4_K's groups of 32 are Folio's int4 groups with a scale d * sc and a minimum -dmin * m (a
float16 times a 6-bit integer: up to 17 significant bits, exact in float32, which Folio's int4
kernels then keep: engine.layers.quantization); Q6_K's groups of 16 are grouped int8 ones, codes
q - 32 with a scale d * sc (a float16 times an int8); dequantizing them here is the same
arithmetic. This module only converts arrays of blocks: it never reads files.
"""

from __future__ import annotations

import torch

# Super-block size of the K-quants, and the bytes of each block type.
QK_K = 256
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q5_0": 32, "Q5_1": 32, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}


def dequantize_blocks(rows: torch.Tensor, type_name: str) -> torch.Tensor:
    """[rows, blocks * block bytes] uint8 -> [rows, blocks * block weights] float32."""
    size = BLOCK_BYTES[type_name]
    if rows.dtype != torch.uint8 or rows.shape[-1] % size:
        raise ValueError(
            f"{type_name} rows must be uint8 of whole {size}-byte blocks, got {rows.dtype} "
            f"rows of {rows.shape[-1]} bytes"
        )
    blocks = rows.reshape(-1, size)
    out = _DEQUANTIZE[type_name](blocks)
    return out.reshape(rows.shape[0], -1)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes start, start + 1 of each block, as [blocks, 1] float32."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2, n]: low nibbles, then high nibbles."""
    return torch.stack((codes & 0x0F, codes >> 4), dim=-2)


def _bits(codes: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: bits width*i .. width*i + width - 1 of each byte."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8)[:, None]
    return (codes[..., None, :] >> shifts) & ((1 << width) - 1)


def _q5(blocks: torch.Tensor, with_minimum: bool) -> torch.Tensor:
    # d, (m), 4 bytes of fifth bits (bit j: weight j's), 16 bytes of low nibbles (byte j: weight
    # j low, weight j + 16 high).
    d = _half(blocks, 0)
    start = 4 if with_minimum else 2
    high = _bits(blocks[:, start : start + 4], 8).transpose(1, 2).reshape(-1, 32)
    low = _nibbles(blocks[:, start + 4 :]).reshape(-1, 32)
    q = (low | (high << 4)).float()
    if with_minimum:
        return d * q + _half(blocks, 2)
    return d * (q - 16)


def _scales_and_minimums(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums, [blocks, 8] each:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); sub-blocks 4-7
    in the nibbles of bytes 8-11, their top two bits in the top bits of bytes 0-3 and 4-7."""
    first, second, last = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((first & 63, (last & 0x0F) | ((first >> 6) << 4)), dim=1)
    minimums = torch.cat((second & 63, (last >> 4) | ((second >> 6) << 4)), dim=1)
    return scales.float(), minimums.float()


def q4_k_groups(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows ([rows, blocks * 144] uint8) as groups of 32 weights, weight = code * scale +
    minimum: codes [rows, weights] uint8 (0-15, in the weights' order), scales and minimums
    [rows, weights / 32] float32, each exact (d * sc and -dmin * m)."""
    size = BLOCK_BYTES["Q4_K"]
    if rows.dtype != torch.uint8 or rows.shape[-1] % size:
        raise ValueError(
            f"Q4_K rows must be uint8 of whole {size}-byte blocks, got {rows.dtype} rows of "
            f"{rows.shape[-1]} bytes"
        )
    q, scale, minimum = _k_quant_groups(rows.reshape(-1, size), fifth_bits=False)
    return (
        q.reshape(rows.shape[0], -1),
        scale.reshape(rows.shape[0], -1),
        minimum.reshape(rows.shape[0], -1),
    )


def _k_quant_groups(
    blocks: torch.Tensor, fifth_bits: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K blocks -> codes [blocks, 8, 32] uint8, scales and minimums [blocks, 8] float32."""
    # d, dmin, 12 bytes of scales and minimums, (Q5_K: 32 bytes of fifth bits: bit s of byte l
    # is weight l of sub-block s's), then 4 chunks of 32 bytes: chunk c's low nibbles are
    # sub-block 2c, its high nibbles sub-block 2c + 1.
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scales, minimums = _scales_and_minimums(blocks[:, 4:16])
    codes = blocks[:, 48:] if fifth_bits else blocks[:, 16:]
    q = _nibbles(codes.reshape(-1, 4, 32)).reshape(-1, 8, 32)
    if fifth_bits:
        q = q | (_bits(blocks[:, 16:48], 8) << 4)
    return q, d * scales, -(dmin * minimums)


def _k_quant(blocks: torch.Tensor, fifth_bits: bool) -> torch.Tensor:
    q, scale, minimum = _k_quant_groups(blocks, fifth_bits)
    # code * scale is exact (at most 22 significant bits); the minimum added in one rounding.
    weights = scale[..., None] * q.float() + minimum[..., None]
    return weights.reshape(-1, QK_K)


def q6_k_groups(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows ([rows, blocks * 210] uint8) as groups of 16 weights, weight = code * scale:
    codes [rows, weights] int8 (-32 to 31, in the weights' order) and scales [rows, weights /
    16] float32, each exact (d * sc: a float16 times an int8, at most 18 significant bits; times
    a code, at most 23: code * scale is exact in float32 too)."""
    size = BLOCK_BYTES["Q6_K"]
    if rows.dtype != torch.uint8 or rows.shape[-1] % size:
        raise ValueError(
            f"Q6_K rows must be uint8 of whole {size}-byte blocks, got {rows.dtype} rows of "
            f"{rows.shape[-1]} bytes"
        )
    q, scale = _q6_k_groups(rows.reshape(-1, size))
    return q.reshape(rows.shape[0], -1), scale.reshape(rows.shape[0], -1)


def _q6_k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks -> codes [blocks, 16, 16] int8 (-32 to 31), scales [blocks, 16] float32."""
    # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 weights), d.
    # Each half of 128 weights: 64 low-nibble bytes l (weight l, then l + 64 from the high
    # nibbles) and 32 bytes of pairs (pair i of byte l: weight l + 32 i's top two bits).
    low = blocks[:, :128].reshape(-1, 2, 2, 32)  # [half, byte group of 32, l]
    low = torch.stack((low & 0x0F, low >> 4), dim=2).reshape(-1, 2, 4, 32)  # weight l + 32 i
    high = _bits(blocks[:, 128:192].reshape(-1, 2, 32), 4, width=2)  # [half, i, l]
    q = (low | (high << 4)).to(torch.int8) - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    return q.reshape(-1, 16, 16), _half(blocks, 208) * scales


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    q, scale = _q6_k_groups(blocks)
    weights = q.float() * scale[..., None]
    return weights.reshape(-1, QK_K)


_DEQUANTIZE = {
    "Q5_0": lambda blocks: _q5(blocks, with_minimum=False),
    "Q5_1": lambda blocks: _q5(blocks, with_minimum=True),
    "Q4_K": lambda blocks: _k_quant(blocks, fifth_bits=False),
    "Q5_K": lambda blocks: _k_quant(blocks, fifth_bits=True),
    "Q6_K": _q6_k,
}
