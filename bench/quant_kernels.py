"""Microbenchmark of the weight-only quantized CPU kernels on the default model's shapes:
`python -m bench.quant_kernels [--method int4] [--rows 1,4,16] [--threads 1,2] [--isa avx2,native]
[--clock wall|cpu] [--shapes] [--baseline REV]`.

One pass multiplies the activations by every linear of SmolLM2-135M (30 layers of qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536, each its own copy so the weights do not stay in
cache, as in a decode step) and then by the vocabulary projection 49152x576 in five forms: int8
per output channel (`--quantization`'s) and grouped int8 with float16 scales per 32 (the default
model's GGUF, Q8_0), each in strips of 16 output channels and row-major (the layouts CPUs with
AVX-512 VNNI and AVX2-only CPUs get by default; `--method int8`'s layers run in strips), and
float32 through oneDNN (the unquantized model's); it prints the median
and fastest milliseconds of the layers and of each projection per row count and thread count,
with `--shapes` also each shape's 30 linears (the fastest pass, and the weights' GB/s at it).
`--dense` also times the layers as a long prefill past the kernels' row limit runs them: one
dense matmul by the dequantized weight (in bfloat16 for int4 where the CPU computes it
natively), in the same turns, to find where that limit belongs.
`--baseline REV` also runs the quantized kernels of git revision REV (its cpu_quant.cpp, built as
an op library of its own beside this checkout's), their passes taking turns with this
checkout's: a before/after of a kernel change in one run, with each figure's ratio to REV's
(REV's weights all row-major, which every revision's kernels read).
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
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.kernels.cpu import extension
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


def grouped_int8(weight: torch.Tensor, strips: bool) -> QuantizedWeight:
    """The weight on a GGUF Q8_0's grid: int8 codes with a float16 scale per 32 inputs, in
    strips of 16 output channels or row-major."""
    groups = weight.unflatten(-1, (-1, 32))
    scale = (groups.abs().amax(-1) / 127).half()
    codes = torch.round(groups / scale.float()[..., None].clamp_min(1e-30)).clamp(-127, 127)
    return grouped_int8_weight(codes.to(torch.int8).flatten(1), scale, strips)


def weights(
    method: str, strips: bool
) -> tuple[dict[str, list[QuantizedWeight]], dict[str, QuantizedWeight]]:
    """The layers' linears (LAYERS copies of each shape) and the vocabulary projection's forms,
    the same values for either `strips`: int8 and grouped int8 in strips of 16 output channels
    or row-major, as `strips` says (the layout AVX-512 VNNI CPUs get by default, or the one
    AVX2-only CPUs get), and the row-major ones always beside them."""
    gen = torch.Generator().manual_seed(0)
    layers: dict[str, list[QuantizedWeight]] = {}
    for out_features, in_features in LAYER_LINEARS:
        weight = torch.randn((out_features, in_features), generator=gen)
        layers[f"{out_features}x{in_features}"] = copies(
            quantize(weight, method, folio_kernels=True, strips=strips), LAYERS
        )
    vocabulary = torch.randn(VOCAB_PROJECTION, generator=gen)
    projections = {
        "int8": quantize(vocabulary, "int8", folio_kernels=True, strips=strips),
        "int8 row-major": quantize(vocabulary, "int8", folio_kernels=True, strips=False),
        "grouped int8": grouped_int8(vocabulary, strips=strips),
        "grouped int8 row-major": grouped_int8(vocabulary, strips=False),
    }
    return layers, projections


def baseline_kernels(revision: str) -> Any:
    """The quantized kernels of git revision `revision`: its cpu_quant.cpp (and the headers
    beside it) compiled with this checkout's flags into an op library of its own,
    torch.ops.folio_quant_baseline, which loads beside this checkout's folio_quant."""
    from torch.utils import cpp_extension

    root = Path(__file__).resolve().parent.parent
    folder = "engine/kernels/cpu"

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, check=True, capture_output=True, text=True
        ).stdout

    commit = git("rev-parse", "--verify", f"{revision}^{{commit}}").strip()
    directory = extension.kernel_dir() / f"quant-baseline-{commit[:12]}"
    directory.mkdir(parents=True, exist_ok=True)
    for name in git("ls-tree", "--name-only", f"{commit}:{folder}").split():
        if name.endswith(".h"):
            (directory / name).write_text(git("show", f"{commit}:{folder}/{name}"))
    source = re.sub(
        r"TORCH_LIBRARY(_IMPL)?\(folio_quant,",
        r"TORCH_LIBRARY\1(folio_quant_baseline,",
        git("show", f"{commit}:{folder}/cpu_quant.cpp"),
    )
    (directory / "cpu_quant.cpp").write_text(source)
    cpp_extension.load(
        name="folio_quant_baseline",
        sources=[str(directory / "cpu_quant.cpp")],
        extra_cflags=list(extension.CFLAGS),
        extra_ldflags=list(extension.LDFLAGS),
        build_directory=str(directory),
        is_python_module=False,
    )
    return torch.ops.folio_quant_baseline


@dataclasses.dataclass
class DenseProduct(QuantizedWeight):
    """A quantized weight whose products run as a long prefill's past the kernels' row limit,
    at any row count."""

    @classmethod
    def of(cls, weight: QuantizedWeight) -> DenseProduct:
        return cls(**{f.name: getattr(weight, f.name) for f in dataclasses.fields(weight)})

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._dense(x)


@dataclasses.dataclass
class Contender:
    """One set of kernels on one ISA: `label` in the output, `isa` the FOLIO_CPU_ISA it runs
    under, its layers (per shape) and vocabulary projections (per form)."""

    label: str
    isa: str
    layers: dict[str, list[QuantizedWeight]]
    heads: dict[str, Callable[[torch.Tensor], torch.Tensor]]


def time_passes(
    contenders: list[Contender],
    xs: dict[int, torch.Tensor],
    repeats: int,
    clock: Callable[[], float],
) -> dict[str, dict[str, list[float]]]:
    """Seconds of each shape's layers, of all of them ("linears") and of each vocabulary
    projection, per contender, in passes over all of them (xs maps input features to
    activations), the contenders taking turns: a projection runs after the layers and the other
    projections, as in a step, so it finds its weight evicted from cache. The first round warms
    up and is dropped."""
    times: dict[str, dict[str, list[float]]] = {c.label: {} for c in contenders}
    for round_ in range(repeats + 1):
        for contender in contenders:
            os.environ[ISA_ENV] = contender.isa
            seconds = {"linears": 0.0}
            for shape, layers in contender.layers.items():
                start = clock()
                for w in layers:
                    w.matmul(xs[w.shape[1]])
                seconds[shape] = clock() - start
                seconds["linears"] += seconds[shape]
            for name, head in contender.heads.items():
                start = clock()
                head(xs[VOCAB_PROJECTION[1]])
                seconds[name] = clock() - start
            if round_:
                for name, value in seconds.items():
                    times[contender.label].setdefault(name, []).append(value)
    return times


def summary(seconds: list[float]) -> str:
    """Median and fastest, in milliseconds (the fastest is the steadier figure on a shared
    machine)."""
    return f"{statistics.median(seconds) * 1e3:7.2f} ms (min {min(seconds) * 1e3:7.2f})"


def weight_bytes(weight: QuantizedWeight) -> int:
    """The bytes a product reads of the weight: codes, scales and minimums."""
    parts = [weight.codes, weight.scale, weight.minimum]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


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
    parser.add_argument("--shapes", action="store_true", help="print each shape's linears")
    parser.add_argument("--baseline", help="git revision whose quantized kernels run too")
    parser.add_argument(
        "--dense", action="store_true", help="also time the dequantized dense products"
    )
    add_clock_argument(parser)
    args = parser.parse_args()
    clock = chosen_clock(parser, args)
    isas = args.isa.split(",")
    if unknown := [isa for isa in isas if isa not in ISA_CHOICES]:
        parser.error(f"--isa takes {', '.join(ISA_CHOICES)}, got {', '.join(unknown)}")

    assert cpu_capabilities().folio_kernels, "Folio's kernels did not load"
    layers, projections = weights(args.method, strips=True)
    gen = torch.Generator().manual_seed(1)  # the activations'
    packed = torch.ops.mkldnn._reorder_linear_weight(
        torch.randn(VOCAB_PROJECTION, generator=gen), None
    )
    kernel_sets = {"": None}
    if args.baseline:
        kernel_sets[f" {args.baseline}"] = baseline_kernels(args.baseline)
        # Row-major int8 and grouped int8 (the layouts every revision's kernels read).
        baseline_layers, baseline_projections = weights(args.method, strips=False)
    contenders = []
    for isa in isas:
        for suffix, kernels in kernel_sets.items():

            def swap(w: QuantizedWeight, kernels: Any = kernels) -> QuantizedWeight:
                return w if kernels is None else dataclasses.replace(w, kernels=kernels)

            own_layers, own_projections = (
                (layers, projections)
                if kernels is None
                else (baseline_layers, baseline_projections)
            )
            heads: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
                name: swap(w).matmul for name, w in own_projections.items()
            }
            heads["float32 oneDNN"] = lambda x: torch.ops.folio_linear.packed_linear(
                x, packed, None
            )
            contenders.append(
                Contender(
                    f"{ISA_ENV}={isa}{suffix}",
                    isa,
                    {shape: [swap(w) for w in ws] for shape, ws in own_layers.items()},
                    heads,
                )
            )
    if args.dense:
        contenders.append(
            Contender(
                "dense (dequantized)",
                isas[0],
                {shape: [DenseProduct.of(w) for w in ws] for shape, ws in layers.items()},
                {},
            )
        )
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            times = time_passes(contenders, xs, args.repeats, clock)
            for index, contender in enumerate(contenders):
                # With --baseline, each contender's ratio to the baseline's on its ISA; the
                # dense products' to the first contender's kernels.
                dense = isinstance(next(iter(contender.layers.values()))[0], DenseProduct)
                base = contenders[0] if dense else None
                if args.baseline and not dense:
                    base = contenders[index | 1]
                report(
                    f"{args.method} threads={threads} rows={rows:2d} {contender.label}",
                    times[contender.label],
                    None if base is None else times[base.label],
                    contender,
                    projections["grouped int8"] if args.shapes and not dense else None,
                )


def report(
    title: str,
    own: dict[str, list[float]],
    base: dict[str, list[float]] | None,
    contender: Contender,
    projection: QuantizedWeight | None,
) -> None:
    """A contender's line of figures (with its ratios to `base`'s fastest passes, if any) and,
    given the grouped int8 projection, a line of each shape's GB/s at its fastest pass."""

    def ratio(name: str) -> str:
        return "" if base is None else f" x{min(base[name]) / min(own[name]):.2f}"

    count = sum(len(ws) for ws in contender.layers.values())
    heads = ", ".join(f"{name} {summary(own[name])}{ratio(name)}" for name in contender.heads)
    print(
        f"{title}: {count} linears {summary(own['linears'])}{ratio('linears')}"
        + (f"; vocabulary {heads}" if heads else ""),
        flush=True,
    )
    if projection is not None:
        weights = {**contender.layers, "grouped int8": [projection]}
        print(
            "    "
            + ", ".join(
                f"{name} {weight_bytes(ws[0]) * len(ws) / min(own[name]) / 1e9:.1f} GB/s"
                + ratio(name)
                for name, ws in weights.items()
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
