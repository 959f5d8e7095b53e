"""Microbenchmark of the CPU's grouped LoRA product alone on the default model's shapes:
`python -m bench.lora_kernel [--rows 16] [--adapters 16] [--threads 1,2] [--clock wall|cpu]`.

One pass is a decode step's LoRA work: Folio's grouped kernel (folio_lora::lora_add) once per
wrapped linear of SmolLM2-135M (30 layers of qkv 576 -> 576+192+192, o 576 -> 576, gate_up
576 -> 1536+1536, down 1536 -> 576; each layer its own slots, so the adapters' weights do not
stay in cache, as in a step), --rows rows spread round-robin over --adapters slots of rank
--rank, in bfloat16 (--dtype). The passes alternate between the kernel's codes (`isa`: AVX-512
with bfloat16's shrink in vdpbf16ps, AVX-512 with every value widened to float32, AVX2; a code
the CPU lacks runs the next one down) and a read of the same bytes (a torch sum over each
slots' A and B, viewed as float32), so that all meet the same load on a shared machine. It
prints each one's fastest and median milliseconds a pass and the rate it reads the used slots'
weights at (GB/s); the read is the bound a pass can reach. With --threads 1 --clock cpu each
pass is timed by this thread's CPU time, which other processes' turns on the core do not
inflate. A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from bench.quant_kernels import add_clock_argument, chosen_clock
from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.layers.lora import ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16, TILE

LAYERS = 30
# (in features, shard outputs) of each wrapped linear of a layer.
LINEARS = [(576, (576, 192, 192)), (576, (576,)), (576, (1536, 1536)), (1536, (576,))]
CODES = {"avx512_bf16": ISA_AVX512_BF16, "avx512": ISA_AVX512, "avx2": ISA_AVX2}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=9)
    add_clock_argument(parser)
    args = parser.parse_args()
    clock = chosen_clock(parser, args)
    assert cpu_capabilities().folio_kernels, "Folio's kernels did not load"

    dtype, gen = DTYPES[args.dtype], torch.Generator().manual_seed(0)
    slots = torch.arange(args.rows, dtype=torch.int32) % args.adapters
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]] = []
    for _ in range(LAYERS):
        for fan_in, shards in LINEARS:
            tiles = sum(-(-n // TILE) for n in shards)
            a = torch.randn(args.adapters, len(shards) * args.rank, fan_in, generator=gen)
            b = torch.randn(args.adapters, tiles, args.rank, TILE, generator=gen)
            x = torch.randn(args.rows, fan_in, generator=gen)
            y = torch.randn(args.rows, sum(shards), generator=gen)
            y, x, a, b = (t.mul(0.05).to(dtype) for t in (y, x, a, b))
            calls.append((y, x, a, b, list(shards)))
    weight_bytes = sum((a.nbytes + b.nbytes) for _, _, a, b, _ in calls)

    def kernel(isa: int) -> Callable[[], None]:
        def run() -> None:
            for y, x, a, b, shards in calls:
                torch.ops.folio_lora.lora_add(y, x, slots, a, b, shards, isa)

        return run

    def read() -> None:
        for _, _, a, b, _ in calls:
            a.view(torch.float32).sum()
            b.view(torch.float32).sum()

    passes = {f"kernel isa={name}": kernel(isa) for name, isa in CODES.items()}
    passes["read of the same bytes"] = read
    print(
        f"{len(calls)} linears, {args.rows} rows over {args.adapters} slots of rank {args.rank}, "
        f"{args.dtype}: {weight_bytes / 1e6:.1f} MB of adapter weights a pass; "
        f"CPU capabilities {cpu_capabilities()}"
    )
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for run in passes.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in passes}
        for _ in range(args.repeats):
            for name, run in passes.items():
                start = clock()
                run()
                times[name].append(clock() - start)
        for name, seconds in times.items():
            fastest = min(seconds)
            print(
                f"threads={threads} {name:26s} {fastest * 1e3:7.2f} ms "
                f"(median {statistics.median(seconds) * 1e3:7.2f}), "
                f"{weight_bytes / fastest / 1e9:5.1f} GB/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
