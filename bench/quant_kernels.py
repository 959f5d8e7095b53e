"""Microbenchmark of the weight-only quantized CPU kernels on the default model's shapes:
`python -m bench.quant_kernels [--method int4] [--rows 1,4,16] [--threads 1,2]`.

One pass multiplies the activations by every linear of SmolLM2-135M (30 layers of qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536, each its own copy so the weights do not stay in
cache, as in a decode step) and then by the int8 vocabulary projection 49152x576; it prints the
median milliseconds of the layers and of the projection per row count and thread count.
A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.layers.quantization import QuantizedWeight, quantize

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


def time_pass(
    layers: list[QuantizedWeight], head: QuantizedWeight, xs: dict[int, torch.Tensor], repeats: int
) -> tuple[str, str]:
    """Median milliseconds of the layers and of the vocabulary projection in passes over both
    (xs maps input features to activations): the projection runs after the layers, as in a step,
    so it finds its weight evicted from cache."""
    layer_times, head_times = [], []
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for w in layers:
            w.matmul(xs[w.codes.shape[1] * (2 if w.method == "int4" else 1)])
        middle = time.perf_counter()
        head.matmul(xs[VOCAB_PROJECTION[1]])
        layer_times.append(middle - start)
        head_times.append(time.perf_counter() - middle)
    return summary(layer_times[1:]), summary(head_times[1:])


def summary(seconds: list[float]) -> str:
    """Median and fastest, in milliseconds (the fastest is the steadier figure on a shared
    machine)."""
    return f"{statistics.median(seconds) * 1e3:7.2f} ms (min {min(seconds) * 1e3:7.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="int4", choices=["int4", "int8"])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    assert cpu_capabilities().folio_kernels, "Folio's kernels did not load"
    gen = torch.Generator().manual_seed(0)
    layers: list[QuantizedWeight] = []
    for shape in LAYER_LINEARS:
        weight = torch.randn(shape, generator=gen)
        layers += copies(quantize(weight, args.method, folio_kernels=True), LAYERS)
    head = quantize(torch.randn(VOCAB_PROJECTION, generator=gen), "int8", folio_kernels=True)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            layer_ms, head_ms = time_pass(layers, head, xs, args.repeats)
            print(
                f"{args.method} threads={threads} rows={rows:2d}: {len(layers)} linears "
                f"{layer_ms}, vocab projection (int8) {head_ms}",
                flush=True,
            )


if __name__ == "__main__":
    main()
