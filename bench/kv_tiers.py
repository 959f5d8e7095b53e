"""`folio bench kv-tiers`: what the KV cache tiers (docs/kv_tiers.md) buy, measured in one run.

Multi-turn: conversations take turns round-robin, each turn its whole history plus a new user
message, so by the time a conversation comes back the others have pushed its blocks out of a
pool that holds a quarter of the working set (the pool is sized from the workload). Run with no
tier, with the host tier (int8 on the CPU) and with the disk tier alone; each prints TTFT p50/p99
of the turns after the first round, the share of prompt tokens served from a cache, and
throughput. Restart: an engine with the disk tier computes a long system prompt and is dropped;
a new engine on the same directory, and a cold one without it, answer one question after it:
the first request's TTFT of each, over several such pairs (a new question each time), and the
ratio of their medians (one pair is at the mercy of a shared machine's load).

The offline engine in-process, one request at a time (TTFT = its prefill); random token ids in
the model's vocabulary. Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

from bench.startup import cpu_description
from common.config import EngineConfig, engine_config_from_args
from common.default_model import prepare_default_model
from common.flags import flag
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine


@dataclass
class KVTiersWorkload:
    """Workload."""

    conversations: int = flag(8, "conversations taking turns")
    rounds: int = flag(4, "turns of each conversation")
    first_turn_tokens: int = flag(448, "tokens of a conversation's first prompt")
    turn_tokens: int = flag(32, "tokens each later turn adds (user message)")
    output_tokens: int = flag(8, "tokens generated per turn")
    system_tokens: int = flag(1500, "tokens of the restart scenario's system prompt")
    restart_trials: int = flag(
        3, "restarts measured, each with a cold start beside it (the medians are compared)"
    )
    working_set_ratio: float = flag(4.0, "working set over the pool's size")

    def __post_init__(self) -> None:
        if self.restart_trials < 1:
            raise ValueError(f"--restart-trials must be >= 1, got {self.restart_trials}")


@dataclass
class Result:
    label: str
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int
    total_tokens: int
    seconds: float

    def line(self) -> str:
        ttfts = sorted(self.ttfts)
        p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
        return (
            f"{self.label:<28} TTFT p50 {statistics.median(ttfts) * 1e3:7.1f} ms  "
            f"p99 {p99 * 1e3:7.1f} ms  cached {self.cached_tokens / self.prompt_tokens:5.1%}  "
            f"throughput {self.total_tokens / self.seconds:7.1f} tok/s"
        )


def one_request(
    engine: LLMEngine, rid: str, ids: list[int], max_tokens: int
) -> tuple[float, list[int], int]:
    """(TTFT seconds, generated ids, cached prompt tokens) of one request run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, ids, params)
    ttft, tokens, cached = 0.0, [], 0
    while engine.has_unfinished:
        for out in engine.step():
            if not ttft and out.new_token_ids:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return ttft, tokens, cached


def multi_turn(config: EngineConfig, work: KVTiersWorkload, label: str) -> Result:
    engine = LLMEngine(config)
    rng = random.Random(0)
    vocab = engine.vocab_size - 1
    histories = [
        [rng.randrange(vocab) for _ in range(work.first_turn_tokens)]
        for _ in range(work.conversations)
    ]
    ttfts, prompt_tokens, cached_tokens, total = [], 0, 0, 0
    start = time.perf_counter()
    for turn in range(work.rounds):
        for c, history in enumerate(histories):
            if turn:
                history += [rng.randrange(vocab) for _ in range(work.turn_tokens)]
            ttft, tokens, cached = one_request(engine, f"{c}.{turn}", history, work.output_tokens)
            history += tokens
            total += len(history)
            if turn:  # the first round is cold for every configuration
                ttfts.append(ttft)
                prompt_tokens += len(history) - len(tokens)
                cached_tokens += cached
    seconds = time.perf_counter() - start
    engine.close()
    return Result(label, ttfts, prompt_tokens, cached_tokens, total, seconds)


def restart(config: EngineConfig, work: KVTiersWorkload, directory: str) -> None:
    rng = random.Random(1)
    system = [rng.randrange(1000, 40000) for _ in range(work.system_tokens)]
    first = LLMEngine(dataclasses.replace(config, kv_cache_dir=directory))
    one_request(first, "warm-up", [*system, 7], 1)
    tiers = first.kv_cache.tiers
    assert tiers is not None and tiers.disk is not None, "the disk tier was asked for"
    tiers.disk.drain()
    first.close()
    del first
    figures: dict[str, list[float]] = {"cold (no disk tier)": [], "restarted, disk tier": []}
    for trial in range(work.restart_trials):
        question = [rng.randrange(1000, 40000) for _ in range(24)]
        for label, tiered in (("cold (no disk tier)", None), ("restarted, disk tier", directory)):
            engine = LLMEngine(dataclasses.replace(config, kv_cache_dir=tiered))
            one_request(engine, "warm", [5, 6, 7], 1)  # first-step costs apart from the prompt
            ttft, _, cached = one_request(engine, "first", system + question, work.output_tokens)
            figures[label].append(ttft)
            print(
                f"restart {trial + 1}: {label:<22} first request TTFT {ttft * 1e3:7.1f} ms "
                f"({cached} of {len(system) + len(question)} prompt tokens cached)",
                flush=True,
            )
            engine.close()
    cold, warm = (statistics.median(ttfts) for ttfts in figures.values())
    print(
        f"restart: TTFT median cold {cold * 1e3:.1f} ms, after a restart with the disk tier "
        f"{warm * 1e3:.1f} ms: {warm / cold:.2f} of cold"
    )


def run_kv_tiers_benchmark(args: argparse.Namespace) -> None:
    work = KVTiersWorkload(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(KVTiersWorkload)}
    )
    config = engine_config_from_args(args)
    config = dataclasses.replace(config, model=config.model or str(prepare_default_model()))
    # The pool holds a 1/ratio share of the working set (all conversations' last turn).
    working = work.conversations * (
        work.first_turn_tokens
        + (work.rounds - 1) * work.turn_tokens
        + work.rounds * work.output_tokens
    )
    num_blocks = max(8, int(working / work.working_set_ratio) // config.block_size)
    config = dataclasses.replace(config, num_kv_blocks=num_blocks)
    print(f"CPU: {cpu_description()}", flush=True)
    print(
        f"{work.conversations} conversations x {work.rounds} turns, working set {working} tokens, "
        f"pool {num_blocks} blocks of {config.block_size} ({num_blocks * config.block_size} "
        f"tokens); TTFT of turns 2..{work.rounds}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="folio-bench-kv-tiers-") as directory:
        runs = (
            ("no tier", config),
            ("host tier (int8)", dataclasses.replace(config, kv_offload_gib=1.0)),
            (
                "host tier (native)",
                dataclasses.replace(config, kv_offload_gib=1.0, kv_offload_format="native"),
            ),
            ("disk tier", dataclasses.replace(config, kv_cache_dir=directory + "/multi-turn")),
        )
        for label, run_config in runs:
            results.append(multi_turn(run_config, work, label))
            print(results[-1].line(), flush=True)
        base = statistics.median(results[0].ttfts)
        for result in results[1:]:
            print(
                f"TTFT p50 no tier / {result.label}: {base / statistics.median(result.ttfts):.2f}x"
            )
        # Restart: a pool that holds the system prompt.
        restart_blocks = 2 * (work.system_tokens + 64) // config.block_size
        restart_config = dataclasses.replace(config, num_kv_blocks=restart_blocks)
        restart(restart_config, work, directory + "/restart")
