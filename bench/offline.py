"""`folio bench offline`: Folio's engine against transformers `generate` on one workload.

Prints figures measured in this run: output tokens/s of both and their ratio, batch-1 decode
tokens/s of both, and the engine's per-phase step time at two batch sizes. With
--tensor-parallel-size N > 1 the engine's figures come for N ranks and, next to them, for one.
A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.flags import flag
from common.gguf_file import is_gguf


@dataclass
class OfflineWorkload:
    """Workload."""

    num_requests: int = flag(128, "requests in the workload")
    min_prompt: int = flag(32, "shortest prompt, in tokens")
    max_prompt: int = flag(512, "longest prompt, in tokens")
    min_output: int = flag(32, "shortest output, in tokens")
    max_output: int = flag(256, "longest output, in tokens")
    workload_seed: int = flag(1234, "seed of the prompts' lengths and tokens")
    hf_batch_size: int = flag(16, "static batch of the transformers baseline")
    hf_dtype: str = flag("float32", "dtype of the transformers baseline")
    skip_hf: bool = flag(False, "measure Folio only")
    phase_batches: str = flag("8,64", "batch sizes for the phase breakdown")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab_size: int, num_special: int = 32) -> Workload:
    rng = random.Random(args.workload_seed)
    prompts, outputs = [], []
    for _ in range(args.num_requests):
        length = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append([rng.randrange(num_special, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(args.min_output, args.max_output))
    return Workload(prompts, outputs)


def _greedy(max_tokens: int):
    from common.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_folio(llm, workload: Workload) -> float:
    """Seconds to serve the whole workload with continuous batching."""
    params = [_greedy(n) for n in workload.output_lens]
    start = time.perf_counter()
    results = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    return elapsed


def folio_decode_rate(llm, prompt: list[int], num_tokens: int) -> float:
    """Batch-1 decode tokens/s: tokens after the first over the time after the first."""
    first = None
    count = 0
    for delta in llm.generate_stream([prompt], _greedy(num_tokens)):
        count += len(delta.token_ids)
        if first is None:
            first = time.perf_counter()
    assert first is not None, "no token came"
    return (count - 1) / (time.perf_counter() - first)


def folio_phases(llm, batch: int, prompt_len: int, decode_steps: int, vocab_size: int) -> dict:
    """Per-phase ms of decode steps with `batch` requests running."""
    engine = llm.engine
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(32, vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"phase-{batch}-{i}", prompt, _greedy(decode_steps + 1))
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    engine.timings.reset()
    while engine.has_unfinished:
        engine.step()
    t = engine.timings
    per_step = {name: 1000 * value / t.steps for name, value in t.as_dict().items()}
    per_step["steps"] = t.steps
    return per_step


def hf_model(model_path: str, dtype: str) -> Any:
    """transformers' model of what Folio ran: a Hugging Face directory, or a GGUF file (the
    default model is one) read by transformers' own GGUF loader, its weights dequantized to
    `dtype` (the same values as Folio's grid, in float)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    source = {"gguf_file": path.name} if is_gguf(path) else {}
    directory = path.parent if source else path
    return AutoModelForCausalLM.from_pretrained(
        directory, dtype=getattr(torch, dtype), **source
    ).eval()


def run_hf(model_dir: str, dtype: str, workload: Workload, batch_size: int) -> float:
    """Seconds for transformers generate over padded static batches, greedy, no EOS stop."""
    import torch

    model = hf_model(model_dir, dtype)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[i : i + batch_size]
        max_new = max(workload.output_lens[i : i + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
    return time.perf_counter() - start


def hf_decode_rate(model_dir: str, dtype: str, prompt: list[int], num_tokens: int) -> float:
    import torch

    model = hf_model(model_dir, dtype)
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    timed(4)  # warm-up
    return (num_tokens - 1) / (timed(num_tokens) - timed(1))


def measure_folio(llm, args: argparse.Namespace, workload: Workload, label: str) -> tuple:
    """Prints Folio's throughput, batch-1 decode rate and step phases; returns the first two."""
    vocab = llm.engine.vocab_size
    decode_prompt = workload.prompts[0][:32]
    folio_generate_warmup = llm.generate([decode_prompt], _greedy(4))
    del folio_generate_warmup

    folio_s = run_folio(llm, workload)
    folio_tps = workload.output_tokens / folio_s
    print(f"{label:12} throughput {folio_tps:8.1f} output tok/s  ({folio_s:.1f} s)")
    folio_b1 = folio_decode_rate(llm, decode_prompt, 128)
    print(f"{label:12} batch-1 decode {folio_b1:6.1f} tok/s")

    for batch in (int(b) for b in args.phase_batches.split(",")):
        phases = folio_phases(llm, batch, prompt_len=256, decode_steps=32, vocab_size=vocab)
        total = sum(
            phases[name] for name in ("schedule", "prepare_inputs", "forward", "sample", "update")
        )
        outside = 100 * (total - phases["forward"]) / total
        print(
            f"{label:12} step phases at batch {batch:3d} (ms/step): "
            + "  ".join(
                f"{k} {phases[k]:.2f}"
                for k in ("schedule", "prepare_inputs", "forward", "sample", "update")
            )
            + f"  total {total:.2f}  outside forward {outside:.1f}%"
        )
    return folio_tps, folio_b1


def run_offline_benchmark(args: argparse.Namespace) -> None:
    import dataclasses
    import os

    import torch

    from common.config import engine_config_from_args
    from engine.llm import LLM

    config = engine_config_from_args(args)
    tp = config.tensor_parallel_size
    llm = LLM(**vars(config))
    workload = make_workload(args, llm.engine.vocab_size)
    model_dir = str(llm.engine.model_path)
    decode_prompt = workload.prompts[0][:32]
    print(
        f"model {model_dir}  dtype {llm.engine.dtype_name}  "
        f"threads {torch.get_num_threads()}" + (f" per rank, {tp} ranks" if tp > 1 else "")
    )
    print(
        f"workload: {len(workload.prompts)} requests, prompts {args.min_prompt}-{args.max_prompt}, "
        f"outputs {args.min_output}-{args.max_output} ({workload.output_tokens} output tokens), "
        f"greedy, ignore_eos"
    )
    with llm:
        folio_tps, folio_b1 = measure_folio(
            llm, args, workload, f"folio tp={tp}" if tp > 1 else "folio"
        )
    if tp > 1:
        # The same engine in one process with every core, for the cost of the collectives.
        single = dataclasses.replace(config, tensor_parallel_size=1, num_threads=None)
        torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
        with LLM(**vars(single)) as one:
            one_tps, one_b1 = measure_folio(one, args, workload, "folio tp=1")
        print(
            f"ratio tp={tp}/tp=1  throughput {folio_tps / one_tps:.2f}x  "
            f"batch-1 decode {folio_b1 / one_b1:.2f}x"
        )

    if args.skip_hf:
        return
    hf_s = run_hf(model_dir, args.hf_dtype, workload, args.hf_batch_size)
    hf_tps = workload.output_tokens / hf_s
    print(
        f"transformers throughput {hf_tps:8.1f} output tok/s  ({hf_s:.1f} s, "
        f"static batches of {args.hf_batch_size}, {args.hf_dtype})"
    )
    hf_b1 = hf_decode_rate(model_dir, args.hf_dtype, decode_prompt, 128)
    print(f"transformers batch-1 decode {hf_b1:6.1f} tok/s ({args.hf_dtype})")
    print(f"ratio throughput  folio/transformers = {folio_tps / hf_tps:.2f}x")
    print(f"ratio batch-1     folio/transformers = {folio_b1 / hf_b1:.2f}x")
