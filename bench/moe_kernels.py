"""`python -m bench.moe_kernels [--tokens 1,16,64,256] [--dtypes float32,bfloat16]
[--weights random,bf16-values]`: one mixture-of-experts layer's step (router and experts) as
Folio runs it against the plain loop over experts in torch that transformers runs, on the CPU
and, where there is one, on a CUDA GPU.

Folio's side is engine.layers.moe.SparseMoe itself: on the CPU, float32 and bfloat16 experts
stacked in one call of Folio's experts kernel (folio_moe::experts; its weights in pairs on AMX
tiles where the CPU has them and the weights are bfloat16 values, or bfloat16 ones for AVX-512
BF16's dot products), bfloat16 ones whose sizes are not multiples of 32 on a CPU with Folio's
bfloat16 tiles each expert once over its gathered tokens through Folio's linears;
on the GPU the fused Triton kernel (pairs sorted by expert, two grouped GEMMs). Float32 runs
twice: random float32 weights, and weights holding bfloat16 values (`bf16-values`: a bfloat16
checkpoint served in float32, which Folio packs in half the bytes), each printed as such. Where
the CPU layer runs stacked, the same layer with its experts one at a time through Folio's linears
(oneDNN-packed float32, or Folio's bfloat16 tiles: the paths before the stacked kernel) is
timed in the same turns too, and where its weights are in pairs on AMX, the same layer stacked
without them (the kernel's AVX-512 code: the path before the AMX one). The baseline routes the
same
way, then for every expert finds its tokens with torch.where, gathers them and runs F.linear on
the expert's weights, adding the weighted results back (transformers' MixtralExperts loop).
Prints the median and fastest milliseconds of each (the two taking turns, so that other work on
a shared machine slows both alike), their ratios, the largest difference between the two
outputs and the load average; on the CPU also the expert products alone on both sides, Folio's
per-expert linears and F.linear (timed in the same turns: what bounds the per-expert path's
ratio) and so the time each step spends around them; where the experts run stacked, reading
their packed weights alone in the same turns (the memory floor, which bounds what any kernel
over those bytes can gain on the loop); on the GPU also the time its kernels take alone
(launched one by one from Python, both sides are bound by the launches at these sizes); with
--profile, torch's profile of each step. A benchmark, not a
test: it asserts nothing else and never runs in the suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F

from engine.layers.attention import get_attention_backend
from engine.layers.moe import Expert, SparseMoe


def random_weights(
    args: argparse.Namespace, dtype: torch.dtype, bf16_values: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router [E, H], gate_up [E, 2I, H], down [E, H, I]), as transformers holds them; with
    `bf16_values`, values bfloat16 holds exactly (a bfloat16 checkpoint loaded in `dtype`)."""
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        values = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
        return (values.bfloat16() if bf16_values else values).to(dtype)

    e, h, i = args.experts, args.hidden, args.intermediate
    return weight(e, h), weight(e, 2 * i, h), weight(e, h, i)


def build_layer(
    args: argparse.Namespace,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    device: str,
    stack: bool = True,
    pairs: bool = True,
) -> SparseMoe:
    """Folio's layer over the same weights, finalized as the loader leaves it (with `stack`
    False, its CPU experts one at a time through Folio's linears; with `pairs` False, none of
    its weights packed in pairs: stacked without AMX tiles, or bfloat16 experts one at a time on
    CPUs with AVX-512 BF16)."""
    router, w13, w2 = weights
    backend = get_attention_backend("auto", device)
    layer = SparseMoe(
        args.hidden, args.experts, args.top_k, args.intermediate, True, backend, w13.dtype, device
    )
    with torch.no_grad():
        layer.gate.weight.copy_(router)
        for e in layer.local_experts:
            expert = cast(Expert, layer.experts[str(e)])
            expert.gate_up_proj.weight.copy_(w13[e])
            expert.down_proj.weight.copy_(w2[e])
    # In the model's order (LlamaForCausalLM.finalize_weights): the block, then its router and
    # experts' linears.
    layer.finalize_weights(stack_cpu_experts=stack, cpu_pairs=pairs)
    for module in layer.modules():
        if module is not layer and (finalize := getattr(module, "finalize_weights", None)):
            finalize()
    return layer


def loop_over_experts(
    x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int
) -> torch.Tensor:
    """transformers' Mixtral step: route, then every expert over the tokens it was given."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights /= weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    for expert in range(w13.shape[0]):
        slot, tokens = torch.where(mask[expert])
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[expert]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, h.to(x.dtype))
    return out


def products(
    layer: SparseMoe, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The step's expert products alone, on Folio's linears and on F.linear: each expert's
    gate_up over as many rows as the router sends it, then its down (what bounds the two
    steps' ratio: both do these, the rest is routing and adding up)."""
    _, ids = layer.gate(x)
    counts = torch.bincount(ids.flatten(), minlength=w13.shape[0]).tolist()
    rows = [(e, x[:count], x.new_ones(count, w2.shape[2])) for e, count in enumerate(counts)]

    def folio() -> None:
        for e, gate_up_rows, down_rows in rows:
            if len(gate_up_rows):
                expert = cast(Expert, layer.experts[str(e)])
                expert.gate_up_proj(gate_up_rows)
                expert.down_proj(down_rows)

    def torch_linear() -> None:
        for e, gate_up_rows, down_rows in rows:
            if len(gate_up_rows):
                F.linear(gate_up_rows, w13[e])
                F.linear(down_rows, w2[e])

    return folio, torch_linear


def read_weights(layer: SparseMoe) -> Callable[[], None] | None:
    """Reading the stacked experts' packed weights once (a reduction over their bytes, on the
    same threads), or None where the layer holds no stack: the memory floor of a step that reads
    every expert, which bounds what any kernel over the same bytes can gain on the loop."""
    stacked = layer.stacked
    if stacked is None or stacked.gate_up is None or stacked.down is None:
        return None
    words = [w.view(torch.int32) for w in (stacked.gate_up, stacked.down)]

    def read() -> None:
        for w in words:
            torch.amax(w)

    return read


def timings_ms(
    steps: Sequence[Callable[[], object]], repeats: int, device: str
) -> list[tuple[float, float]]:
    """Median and fastest milliseconds of each call, the calls taking turns (a burst of other
    work on a shared machine then slows them alike; the fastest is the steadier figure)."""
    times: list[list[float]] = [[] for _ in steps]
    for repeat in range(repeats + 2):  # two warm-up rounds
        for step, measured in zip(steps, times, strict=True):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            if repeat >= 2:
                measured.append(time.perf_counter() - start)
    return [(statistics.median(t) * 1e3, min(t) * 1e3) for t in times]


def gpu_kernel_ms(step: Callable[[], object], calls: int = 10) -> float:
    """Milliseconds the GPU spends in a call's kernels (torch's profiler, their device time
    added up): what a step costs where its launches are replayed from a CUDA graph, as the
    engine's decode steps are, rather than issued one by one from Python."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CUDA]) as recorded:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    kernels = sum(event.self_device_time_total for event in recorded.key_averages())
    return kernels / 1e3 / calls


def profile(step: Callable[[], object], label: str) -> None:
    """Where a step's time goes: torch's profiler, the ops by their own CPU time."""
    from torch.profiler import profile as profiler

    with profiler() as recorded:
        for _ in range(10):
            step()
    print(f"{label}, 10 calls:")
    print(recorded.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def in_pairs(layer: SparseMoe) -> bool:
    """Whether the layer's stacked experts have their panels in pairs (AMX's tiles, or AVX-512
    BF16's dot products for bfloat16 activations)."""
    stacked = layer.stacked
    return stacked is not None and stacked.gate_up is not None and stacked.gate_up.shape[-1] == 64


def on_amx(layer: SparseMoe) -> bool:
    """Whether the layer's stacked experts run on AMX tiles."""
    return in_pairs(layer) and bool(torch.ops.folio_moe.amx_usable())


def run(args: argparse.Namespace, device: str, dtype: torch.dtype, bf16_values: bool) -> None:
    weights = random_weights(args, dtype, bf16_values)
    layer = build_layer(args, weights, device)
    stacked = layer.stacked is not None and layer.stacked.gate_up is not None
    # The CPU experts one at a time (what the stacked kernel replaced), and its linears.
    per_expert = build_layer(args, weights, device, stack=False) if not layer.fused else None
    # Where the layer runs on AMX, the same layer without it (the kernel's AVX-512 code; a
    # bfloat16 layer then runs one expert at a time on CPUs with Folio's tiles: per_expert).
    without_amx = build_layer(args, weights, device, pairs=False) if on_amx(layer) else None
    if without_amx is not None and without_amx.stacked is None:
        without_amx = None
    router, w13, w2 = (w.to(device) for w in weights)
    generator = torch.Generator().manual_seed(1)
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=generator).to(dtype).to(device)
        baseline = partial(loop_over_experts, x, router, w13, w2, args.top_k)
        with torch.inference_mode():
            steps: list[Callable[[], object]] = [partial(layer, x), baseline]
            if without_amx is not None:
                steps.append(partial(without_amx, x))
            if stacked and per_expert is not None:
                steps.append(partial(per_expert, x))
            if per_expert is not None:  # the CPU path's products, timed in the same turns
                steps.extend(products(per_expert, x, w13, w2))
            if floor_step := read_weights(layer):
                steps.append(floor_step)
            ours, loop, *rest = timings_ms(steps, args.repeats, device)
            floor = rest.pop() if floor_step else None
            avx512 = rest.pop(0) if without_amx is not None else None
            one_at_a_time, alone = (rest[0], rest[1:]) if stacked else (None, rest)
            expected = baseline().float()
            error = (layer(x).float() - expected).abs().max().item()
        path = (
            "fused Triton kernel"
            if layer.fused
            else "stacked experts kernel, AMX"
            if on_amx(layer)
            else "stacked experts kernel, AVX-512 BF16 pairs"
            if in_pairs(layer)
            else "stacked experts kernel"
            if stacked
            else "per expert, Folio's linears"
        )
        name = str(dtype).removeprefix("torch.")
        if bf16_values and dtype != torch.bfloat16:
            name += " (bfloat16 values)"
        label = f"{device} {name:8s} tokens={tokens:4d}"
        print(
            f"{label}: Folio ({path}) {ours[0]:8.3f} ms (min {ours[1]:8.3f}), loop over "
            f"experts {loop[0]:8.3f} ms (min {loop[1]:8.3f}): x{loop[0] / ours[0]:5.2f} "
            f"(fastest x{loop[1] / ours[1]:5.2f}; max difference {error:.1e}; load average "
            f"{os.getloadavg()[0]:.2f})",
            flush=True,
        )
        if floor:
            assert layer.stacked is not None and layer.stacked.gate_up is not None
            assert layer.stacked.down is not None
            megabytes = (layer.stacked.gate_up.nbytes + layer.stacked.down.nbytes) / 1e6
            print(
                f"{' ' * len(label)}  reading its packed weights alone ({megabytes:.1f} MB) "
                f"{floor[0]:8.3f} ms (min {floor[1]:8.3f}): Folio x{floor[0] / ours[0]:5.2f} that "
                f"floor (fastest x{floor[1] / ours[1]:5.2f}), the loop at most x"
                f"{loop[0] / floor[0]:5.2f} (fastest x{loop[1] / floor[1]:5.2f}) for any kernel "
                "over these bytes",
                flush=True,
            )
        if avx512:
            before, before_min = avx512
            print(
                f"{' ' * len(label)}  Folio stacked without AMX {before:8.3f} ms (min "
                f"{before_min:8.3f}): x{loop[0] / before:5.2f} the loop (fastest "
                f"x{loop[1] / before_min:5.2f}); AMX x{before / ours[0]:5.2f} it (fastest "
                f"x{before_min / ours[1]:5.2f})",
                flush=True,
            )
        if one_at_a_time:
            before, before_min = one_at_a_time
            print(
                f"{' ' * len(label)}  Folio per expert (Folio's linears) {before:8.3f} ms (min "
                f"{before_min:8.3f}): x{loop[0] / before:5.2f} the loop (fastest "
                f"x{loop[1] / before_min:5.2f}); stacked x{before / ours[0]:5.2f} per expert "
                f"(fastest x{before_min / ours[1]:5.2f})",
                flush=True,
            )
        if alone:
            (folio, folio_min), (torch_ms, torch_min) = alone
            around = one_at_a_time or ours
            print(
                f"{' ' * len(label)}  the expert products alone: Folio's linears {folio:8.3f} "
                f"ms (min {folio_min:8.3f}), F.linear {torch_ms:8.3f} ms (min {torch_min:8.3f}); "
                f"around them Folio per expert {around[0] - folio:6.3f} ms (fastest "
                f"{around[1] - folio_min:6.3f}), the loop {loop[0] - torch_ms:6.3f} ms (fastest "
                f"{loop[1] - torch_min:6.3f})",
                flush=True,
            )
        if device == "cuda":
            with torch.inference_mode():
                fused, looped = gpu_kernel_ms(partial(layer, x)), gpu_kernel_ms(baseline)
            print(
                f"{' ' * len(label)}  the GPU's kernel time alone (profiler): Folio {fused:8.3f} "
                f"ms, loop over experts {looped:8.3f} ms: x{looped / fused:5.2f} (a step "
                "replayed from a CUDA graph pays this, not the launches)",
                flush=True,
            )
        if args.profile:
            with torch.inference_mode():
                profile(partial(layer, x), f"{label}, Folio")
                profile(baseline, f"{label}, loop over experts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    # A Mixtral scaled down by 8 in both sizes: 25 MiB of float32 experts.
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--weights",
        default="random,bf16-values",
        help="random: random values of the dtype; bf16-values: float32 weights holding "
        "bfloat16 values (a bfloat16 checkpoint served in float32; for bfloat16 the same)",
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch's default)")
    parser.add_argument("--profile", action="store_true", help="print where each step's time goes")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert intermediate "
        f"{args.intermediate}; CPU threads {torch.get_num_threads()}",
        flush=True,
    )
    weights = args.weights.split(",")
    if unknown := set(weights) - {"random", "bf16-values"}:
        parser.error(f"--weights: random or bf16-values, not {', '.join(sorted(unknown))}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            # bfloat16's random weights are bfloat16 values already: one case.
            cases = weights[:1] if dtype == torch.bfloat16 else weights
            for case in cases:
                run(args, device, dtype, case == "bf16-values")


if __name__ == "__main__":
    main()
