"""`folio bench lora`: many LoRA adapters on one engine against the base model alone.

One workload (--streams greedy requests, all at once: --prompt-tokens each, --output-tokens
generated) runs on the engine without LoRA and on an engine with --max-loras slots, its streams
spread round-robin over 1, 4 and 16 adapters of rank --lora-rank on every q/k/v/o and
gate/up/down (and once with no adapter named, for the wrappers' own cost). Both engines are
held at once and the cases run in turn, --repeats rounds, so that the shared machine's load
weighs on every case alike. It prints output tokens/s of each (its fastest run) with its ratio
to the base model's, and how long loading one adapter takes (reading and checking its files
into host memory; copying it into a slot is timed apart). The adapters are random PEFT-format
files written to a temporary --lora-root. Both engines run their decode steps compiled on the
CPU unless --enforce-eager (the programs are built or loaded when each engine starts, before
any timing; the line under the figures says how the decode steps ran). A benchmark, not a
test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import EngineConfig, engine_config_from_args
from common.flags import flag
from common.sampling_params import SamplingParams

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


@dataclass
class LoraWorkload:
    """Workload."""

    streams: int = flag(16, "requests running at once")
    prompt_tokens: int = flag(32, "tokens of each prompt")
    output_tokens: int = flag(64, "tokens each request generates")
    lora_rank: int = flag(16, "rank of the adapters")
    adapter_counts: str = flag("1,4,16", "how many adapters the streams spread over, per run")
    repeats: int = flag(
        2, "rounds over the cases (one run of each); each case's fastest counts (shared machine)"
    )


def write_adapter(directory: Path, config: dict, rank: int, seed: int) -> None:
    """A random adapter in PEFT's format for a model of `config` (its config.json)."""
    import torch
    from safetensors.torch import save_file

    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in TARGETS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator)
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator)
    directory.mkdir(parents=True)
    save_file({k: v * 0.01 for k, v in tensors.items()}, directory / "adapter_model.safetensors")
    adapter_config = dict(
        peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(shapes)
    )
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))


def run_streams(
    engine, prompts: list[list[int]], loras: list[str | None], max_tokens: int
) -> float:
    """Output tokens/s of every prompt at once, each with its adapter."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params, lora_name=lora)
    generated = 0
    while engine.has_unfinished:
        generated += sum(len(out.new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


def decode_steps(engine) -> str:
    """How the engine ran its decode steps, in words."""
    compiled = getattr(engine.executor, "runner", None)
    compiled = getattr(compiled, "compiled_decode", None)
    if compiled is None or not compiled.ready:
        return "eagerly"
    return f"compiled ({sum(compiled.rows_run.values())} steps)"


def run_lora_benchmark(args: argparse.Namespace) -> None:
    from bench.startup import cpu_description
    from engine.engine import LLMEngine

    config: EngineConfig = engine_config_from_args(args)
    counts = [int(c) for c in args.adapter_counts.split(",")]
    rng = random.Random(1234)
    with tempfile.TemporaryDirectory(prefix="folio-bench-lora-") as root:
        base = LLMEngine(
            dataclasses.replace(config, max_num_seqs=max(config.max_num_seqs, args.streams))
        )
        model_config = json.loads((base.model_path / "config.json").read_text())
        vocab = base.vocab_size
        prompts = [
            [rng.randrange(32, vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.streams)
        ]

        print(f"CPU: {cpu_description()}")
        print(
            f"model {base.model_path.name}, {base.dtype_name}; {args.streams} streams of "
            f"{args.prompt_tokens} prompt tokens, {args.output_tokens} generated each; "
            f"adapters of rank {args.lora_rank} on q/k/v/o/gate/up/down"
        )
        most = max(counts)
        lora = LLMEngine(
            dataclasses.replace(
                config,
                max_num_seqs=max(config.max_num_seqs, args.streams),
                lora_root=root,
                max_loras=max(config.max_loras, most),
                max_lora_rank=max(config.max_lora_rank, args.lora_rank),
            )
        )
        loads, activations = [], []
        for i in range(most):
            write_adapter(Path(root, f"a{i}"), model_config, args.lora_rank, seed=i)
            t0 = time.perf_counter()
            lora.load_lora_adapter(f"a{i}", f"a{i}")
            loads.append(time.perf_counter() - t0)
            registry, backend = lora.lora, lora.executor.lora_backend
            assert registry is not None and backend is not None
            adapter = registry.adapters[f"a{i}"]
            t0 = time.perf_counter()
            backend.activate_lora(i % registry.max_loras, adapter.adapter_id)
            activations.append(time.perf_counter() - t0)
        no_adapter: list[str | None] = [None] * args.streams
        cases: list[tuple[str, LLMEngine, list[str | None]]] = [
            ("base model alone", base, no_adapter),
            ("LoRA engine, no adapter used", lora, no_adapter),
        ]
        for count in counts:
            names: list[str | None] = [f"a{i % count}" for i in range(args.streams)]
            cases.append((f"{count:2d} adapter(s)", lora, names))
        for _, engine, loras in cases:
            run_streams(engine, prompts[:2], loras[:2], 4)  # warm-up
        # Round-robin over the cases, the fastest run of each counting: a change in the shared
        # machine's load between cases weighs on all of them, not on one.
        best = dict.fromkeys((label for label, _, _ in cases), 0.0)
        for _ in range(args.repeats):
            for label, engine, loras in cases:
                tps = run_streams(engine, prompts, loras, args.output_tokens)
                best[label] = max(best[label], tps)
        base_tps = best["base model alone"]
        for label, tps in best.items():
            print(f"{label:28s} {tps:8.1f} tok/s   {tps / base_tps:.2f}x")
        print(f"decode steps: base engine {decode_steps(base)}, LoRA engine {decode_steps(lora)}")
        base.close()
        lora.close()
        print(
            f"adapter load (files -> host memory, checked): median "
            f"{statistics.median(loads) * 1e3:.0f} ms, max {max(loads) * 1e3:.0f} ms over "
            f"{len(loads)}; into a slot: median {statistics.median(activations) * 1e3:.1f} ms"
        )
