"""Microbenchmark of the weight-only quantized CPU kernels on the default model's shapes:
`python -m bench.quant_kernels [--method int4] [--rows 1,4,16] [--threads 1,2] [--isa avx2,native]
[--clock wall|cpu]`.

One pass multiplies the activations by every linear of SmolLM2-135M (30 layers of qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536, each its own copy so the weights do not stay in
cache, as in a decode step) and then by the vocabulary projection 49152x576 in three forms: int8
per output channel (`--quantization`'s), grouped int8 with float16 scales per 32 (the default
model's GGUF, Q8_0) and float32 through oneDNN (the unquantized model's); it prints the median
and fastest milliseconds of the layers and of each projection per row count and thread count.
With several `--isa` values (FOLIO_CPU_ISA, which Folio's kernels read at every call: avx2
forces their AVX2 code on a CPU with AVX-512 VNNI) the passes alternate between them, so that
both meet the same load on a shared machine; there `--threads 1 --clock cpu` times each product
by this thread's CPU time, which other processes' turns on the core do not inflate.
A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import torch

from engine.kernels.cpu.capabilities import ISA_CHOICES, ISA_ENV, cpu_capabilities
from engine.layers.quantization import QuantizedWeight, grouped_int8_weight, quantize

LAYERS = 30
LAYER_LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
VOCAB_PROJECTION = (49152, 576)


def copies(weight: QuantizedWeight, count: int) -> list[QuantizedWeight]:
    """`count` independent copies of a quantized weight (distinct memory, same values)."""

    def clone(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    return [
        dataclasses.replace(
            weight,
            codes=weight.codes.clone(),
            scale=weight.scale.clone(),
            minimum=clone(weight.minimum),
        )
        for _ in range(count)
    ]


def grouped_int8(weight: torch.Tensor) -> QuantizedWeight:
    """The weight on a GGUF Q8_0's grid: int8 codes with a float16 scale per 32 inputs."""
    groups = weight.unflatten(-1, (-1, 32))
    scale = (groups.abs().amax(-1) / 127).half()
    codes = torch.round(groups / scale.float()[..., None].clamp_min(1e-30)).clamp(-127, 127)
    return grouped_int8_weight(codes.to(torch.int8).flatten(1), scale)


def time_passes(
    layers: list[QuantizedWeight],
    heads: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    xs: dict[int, torch.Tensor],
    isas: list[str],
    repeats: int,
    clock: Callable[[], float],
) -> dict[str, dict[str, list[float]]]:
    """Seconds of the layers ("linears") and of each vocabulary projection, per ISA, in passes
    over all of them (xs maps input features to activations), the ISAs taking turns: a
    projection runs after the layers and the other projections, as in a step, so it finds its
    weight evicted from cache. The first round warms up and is dropped."""
    times: dict[str, dict[str, list[float]]] = {
        isa: {name: [] for name in ["linears", *heads]} for isa in isas
    }
    for round_ in range(repeats + 1):
        for isa in isas:
            os.environ[ISA_ENV] = isa
            start = clock()
            for w in layers:
                w.matmul(xs[w.codes.shape[1] * (2 if w.method == "int4" else 1)])
            seconds = {"linears": clock() - start}
            for name, head in heads.items():
                start = clock()
                head(xs[VOCAB_PROJECTION[1]])
                seconds[name] = clock() - start
            if round_:
                for name, value in seconds.items():
                    times[isa][name].append(value)
    return times


def summary(seconds: list[float]) -> str:
    """Median and fastest, in milliseconds (the fastest is the steadier figure on a shared
    machine)."""
    return f"{statistics.median(seconds) * 1e3:7.2f} ms (min {min(seconds) * 1e3:7.2f})"


def add_clock_argument(parser: argparse.ArgumentParser) -> None:
    """--clock: wall time, or (one thread) that thread's CPU time, which other processes on a
    shared machine disturb far less."""
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"])


def chosen_clock(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable[[], float]:
    """The clock --clock names; refused with more than one thread (`args.threads`)."""
    if args.clock == "cpu" and str(args.threads) != "1":
        parser.error("--clock cpu times one thread: use it with --threads 1")
    return time.thread_time if args.clock == "cpu" else time.perf_counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="int4", choices=["int4", "int8"])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--isa", default="native", help="FOLIO_CPU_ISA values, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    add_clock_argument(parser)
    args = parser.parse_args()
    clock = chosen_clock(parser, args)
    isas = args.isa.split(",")
    if unknown := [isa for isa in isas if isa not in ISA_CHOICES]:
        parser.error(f"--isa takes {', '.join(ISA_CHOICES)}, got {', '.join(unknown)}")

    assert cpu_capabilities().folio_kernels, "Folio's kernels did not load"
    gen = torch.Generator().manual_seed(0)
    layers: list[QuantizedWeight] = []
    for shape in LAYER_LINEARS:
        weight = torch.randn(shape, generator=gen)
        layers += copies(quantize(weight, args.method, folio_kernels=True), LAYERS)
    vocabulary = torch.randn(VOCAB_PROJECTION, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(vocabulary, None)
    heads: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "int8": quantize(vocabulary, "int8", folio_kernels=True).matmul,
        "grouped int8": grouped_int8(vocabulary).matmul,
        "float32 oneDNN": lambda x: torch.ops.folio_linear.packed_linear(x, packed, None),
    }
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            times = time_passes(layers, heads, xs, isas, args.repeats, clock)
            for isa in isas:
                print(
                    f"{args.method} threads={threads} rows={rows:2d} {ISA_ENV}={isa}: "
                    f"{len(layers)} linears {summary(times[isa]['linears'])}; vocabulary "
                    + ", ".join(f"{name} {summary(times[isa][name])}" for name in heads),
                    flush=True,
                )


if __name__ == "__main__":
    main()
