"""Microbenchmark of the CPU paged decode attention on the default model's shapes:
`python -m bench.attention_kernels [--shapes 16x1000,1x4000,5x1000] [--isa native,avx2]
[--dtype bfloat16] [--cache-dtype bfloat16|float8_e4m3fn|float8_e5m2] [--layers 30]
[--block-size 16] [--repeats 10] [--same-request] [--cached]`.

Each shape is ROWSxCONTEXT: decode rows (different requests, unless `--same-request`: a
verification step's rows, one request's consecutive positions through one table) seeing CONTEXT
positions of a paged KV cache of SmolLM2-135M's heads (9 query heads, 3 KV heads of 64, blocks of
16 positions, or --block-size), the cache in --dtype or in --cache-dtype (bfloat16 under float32
rows: `--kv-cache-dtype bfloat16`; float8_e4m3fn or float8_e5m2 under either: fp8, fp8_e5m2).
As in a served decode step, every layer has its own cache and each request's blocks lie
scattered over a pool twice as large as the contexts need, so that a pass over all the layers
reads their KV from memory, not from cache (with `--cached`, one layer's cache called again and
again instead: what the kernels' arithmetic alone costs). One
pass calls torch.ops.folio_cpu_attention.paged_decode_attention once per layer; it prints the
median and fastest microseconds per layer call, and the KV bytes per second at the median (each
request's positions counted once). With several `--isa` values (FOLIO_CPU_ISA, which the
kernels read at every call: avx2 holds a CPU with AVX-512 to its AVX2 code) the passes alternate
between them, so that both meet the same load on a shared machine. A benchmark, not a test: it
asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from engine.kernels.cpu import extension

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def build(
    rows: int,
    context: int,
    layers: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    same_request: bool,
    block: int,
):
    """(the op's arguments without the cache, the layers' caches, the KV bytes a call reads)."""
    generator = torch.Generator().manual_seed(0)
    longest = context + (rows - 1 if same_request else 0)
    blocks = -(-longest // block)
    requests = 1 if same_request else rows
    pool = 2 * blocks * requests
    caches = [torch.randn(2, pool, block, KV_HEADS, HEAD_DIM, generator=generator).to(cache_dtype)]
    caches += [torch.empty_like(caches[0]).copy_(caches[0]) for _ in range(layers - 1)]
    scattered = torch.randperm(pool, generator=generator)[: blocks * requests]
    tables = scattered.to(torch.int32).view(requests, blocks)
    if same_request:
        tables = tables.expand(rows, blocks).contiguous()
        lengths = torch.arange(context, context + rows, dtype=torch.int32)
    else:
        lengths = torch.full((rows,), context, dtype=torch.int32)
    last = (lengths - 1).long()
    slots = tables.gather(1, (last // block).view(-1, 1)).view(-1).long() * block + last % block
    q, k, v = (
        torch.randn(rows, n, HEAD_DIM, generator=generator).to(dtype)
        for n in (HEADS, KV_HEADS, KV_HEADS)
    )
    positions = int(lengths.sum()) if not same_request else int(lengths[-1])
    read = positions * 2 * KV_HEADS * HEAD_DIM * caches[0].element_size()
    return (q, k, v, slots, tables, lengths), caches, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16x1000,1x4000,5x1000", help="ROWSxCONTEXT, ...")
    parser.add_argument("--isa", default="native,avx2", help="FOLIO_CPU_ISA values to alternate")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--cache-dtype",
        default=None,
        choices=["bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"],
        help="default: --dtype",
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=16, help="positions a KV block holds")
    parser.add_argument("--repeats", type=int, default=10, help="passes per shape and ISA")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch's default)")
    parser.add_argument(
        "--same-request",
        action="store_true",
        help="rows of one request (a verification step), not of different ones",
    )
    parser.add_argument(
        "--cached",
        action="store_true",
        help="call one layer's cache again and again (the arithmetic alone)",
    )
    args = parser.parse_args()
    if not extension.load():
        raise SystemExit("Folio's CPU kernels did not load (see the warning above)")
    if args.threads:
        torch.set_num_threads(args.threads)
    decode = torch.ops.folio_cpu_attention.paged_decode_attention
    dtype = getattr(torch, args.dtype)
    cache_dtype = getattr(torch, args.cache_dtype or args.dtype)
    isas = args.isa.split(",")
    before = os.environ.get("FOLIO_CPU_ISA")
    print(
        f"paged decode attention, {args.dtype} rows, a {args.cache_dtype or args.dtype} cache, "
        f"{HEADS} heads / {KV_HEADS} KV heads of "
        f"{HEAD_DIM}, blocks of {args.block_size}, {args.layers} layers "
        f"{'(one cache, cached)' if args.cached else '(scattered blocks, KV from memory)'}, "
        f"{torch.get_num_threads()} threads, CPU {torch.backends.cpu.get_cpu_capability()}"
    )
    for shape in args.shapes.split(","):
        rows, context = (int(x) for x in shape.split("x"))
        (q, k, v, slots, tables, lengths), caches, read = build(
            rows, context, args.layers, dtype, cache_dtype, args.same_request, args.block_size
        )
        calls = [caches[0]] * args.layers if args.cached else caches
        times: dict[str, list[float]] = {isa: [] for isa in isas}
        for turn in range(args.repeats + 1):
            for isa in isas:
                os.environ["FOLIO_CPU_ISA"] = isa
                start = time.perf_counter()
                for cache in calls:
                    decode(q, k, v, cache, slots, tables, lengths, HEAD_DIM**-0.5)
                if turn:  # the first pass of each warms up
                    times[isa].append((time.perf_counter() - start) / len(calls))
        for isa in isas:
            median = statistics.median(times[isa])
            print(
                f"{rows:3d} rows x {context:5d} positions{' (one request)' * args.same_request}, "
                f"{isa:6s}: {median * 1e6:7.1f} us a layer (fastest {min(times[isa]) * 1e6:7.1f}),"
                f" {read / median / 1e9:5.1f} GB/s of KV"
            )
    if before is None:
        del os.environ["FOLIO_CPU_ISA"]
    else:
        os.environ["FOLIO_CPU_ISA"] = before


if __name__ == "__main__":
    main()
