"""Microbenchmark of the CPU linear kernels a decode step runs, on the default model's shapes:
`python -m bench.avx2_kernels [--rows 1,16] [--threads 2] [--clock wall|cpu]`.

One pass multiplies the activations by every linear of SmolLM2-135M (bench.quant_kernels' 120
linears, each its own copy so the weights do not stay in cache, as in a decode step) in each form
Folio has: float32 through oneDNN (packed_linear, the float32 path), bfloat16 weights widened to
float32 in registers (widened_bf16_linear, AVX2), int8 and int4 through Folio's integer kernels
(AVX2 maddubs/madd), and, where the CPU has AVX-512 BF16, bfloat16 tiles (bf16_linear). It
prints per path and row count the median and fastest milliseconds of a pass, the weights' GB/s
at the fastest pass and rows / fastest pass as tokens per second (linears only, no attention).
To measure an AVX2-only CPU's paths on one with AVX-512, run with FOLIO_CPU_ISA=avx2 (Folio's
capability probe) and ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's float32 kernels): the header says which
ISA each ran. On a shared machine `--threads 1 --clock cpu` times the pass by this thread's CPU
time (the kernels then run on the calling thread), which other processes disturb far less than
the wall clock. A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections.abc import Callable

import torch

from bench.quant_kernels import LAYER_LINEARS, LAYERS, add_clock_argument, chosen_clock
from bench.startup import cpu_description
from engine.kernels.cpu.capabilities import cpu_capabilities, forced_isa
from engine.layers.linear import PackedWeight, linear, pack_weight

# How a path packs a float32 weight holding bfloat16 values.
Packer = Callable[[torch.Tensor], PackedWeight | None]


def paths() -> dict[str, tuple[torch.dtype, Packer]]:
    """Path name -> (activation dtype, how a bfloat16-valued float32 weight is packed)."""
    caps = cpu_capabilities()
    # What an AVX2-only CPU's probe says, whatever this one's does: the widened path.
    avx2 = dataclasses.replace(caps, avx512_bf16=False)
    found: dict[str, tuple[torch.dtype, Packer]] = {
        "float32 oneDNN (packed_linear)": (
            torch.float32,
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
        ),
        "bf16 weights widened, AVX2 (widened_bf16_linear)": (
            torch.float32,
            lambda w: pack_weight(w, None, avx2),
        ),
        "int8, AVX2 madd (int8_linear)": (torch.float32, lambda w: pack_weight(w, "int8", caps)),
        "int4, AVX2 maddubs (int4_linear)": (torch.float32, lambda w: pack_weight(w, "int4", caps)),
    }
    if caps.bf16_tiles:
        found["bf16 tiles, AVX-512 BF16 (bf16_linear)"] = (
            torch.bfloat16,
            lambda w: pack_weight(w.bfloat16(), None, caps),
        )
    return found


def weight_bytes(packed: PackedWeight | None) -> int:
    tensors = [v for v in getattr(packed, "__dict__", {}).values() if isinstance(v, torch.Tensor)]
    if isinstance(packed, torch.Tensor):
        return packed.numel() * packed.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    add_clock_argument(parser)
    args = parser.parse_args()
    clock = chosen_clock(parser, args)

    assert cpu_capabilities().folio_kernels, "Folio's kernels did not load"
    torch.set_num_threads(args.threads)
    print(cpu_description())
    print(
        f"Folio's probe: {forced_isa()} ({cpu_capabilities()}); "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}; "
        f"threads {args.threads}, {args.clock} clock",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    # bfloat16 values held in float32: a bfloat16 checkpoint loaded for float32 activations.
    weights = [
        torch.randn(shape, generator=gen).bfloat16().float()
        for shape in LAYER_LINEARS
        for _ in range(LAYERS)
    ]
    for name, (dtype, pack) in paths().items():
        packed = [(w, pack(w)) for w in weights]
        total = sum(weight_bytes(p) for _, p in packed)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (576, 1536)}
            seconds = []
            for _ in range(args.repeats + 1):  # the first pass warms up
                start = clock()
                for w, p in packed:
                    linear(xs[w.shape[1]], w, p)
                seconds.append(clock() - start)
            fastest, median = min(seconds[1:]), statistics.median(seconds[1:])
            print(
                f"{name:50s} rows={rows:2d}: {median * 1e3:7.2f} ms (min {fastest * 1e3:7.2f}), "
                f"{total / fastest / 1e9:5.1f} GB/s of {total / 1e6:.0f} MB, "
                f"{rows / fastest:7.1f} tok/s",
                flush=True,
            )
        del packed


if __name__ == "__main__":
    main()
