"""`folio bench kv-tiers`: what the KV cache tiers (docs/kv_tiers.md) buy, measured in one run.

Multi-turn: conversations take turns round-robin, each turn its whole history plus a new user
message, so by the time a conversation comes back the others have pushed its blocks out of a
pool that holds a quarter of the working set (the pool is sized from the workload). Run with no
tier, with the host tier (int8 and native), with the disk tier alone and, as the ceiling, with
a pool holding the whole working set, one engine each, all held at once and taking every turn
in lockstep (the shared machine's load falls on each alike); each prints TTFT p50/p99 of the
turns after the first round, the share of prompt tokens served from a cache, and throughput
(tokens over its own requests' time). Restart: an engine with the disk tier computes a long
system prompt and is dropped; a new engine on the same directory, and a cold one without it,
answer one question after it: the first request's TTFT of each, over several such pairs (a new
question each time), and the ratio of their medians (one pair is at the mercy of a shared
machine's load).

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
from typing import TYPE_CHECKING

from bench.startup import cpu_description
from common.config import EngineConfig, engine_config_from_args
from common.default_model import prepare_default_model
from common.flags import flag
from common.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported where engines are made: `folio`'s parser reads the workload here
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


def multi_turn(runs: list[tuple[str, EngineConfig]], work: KVTiersWorkload) -> list[Result]:
    """The workload on one engine per configuration, all held at once and taking each turn in
    lockstep (a turn on every engine, then the next turn), so that the shared machine's load
    weighs on every configuration alike. Each engine keeps its own histories (the int8 tier's
    answers may differ); the user messages are the same for all."""
    from engine.engine import LLMEngine

    engines = [LLMEngine(config) for _, config in runs]
    rng = random.Random(0)
    vocab = engines[0].vocab_size - 1
    firsts = [
        [rng.randrange(vocab) for _ in range(work.first_turn_tokens)]
        for _ in range(work.conversations)
    ]
    histories = [[list(first) for first in firsts] for _ in runs]
    ttfts: list[list[float]] = [[] for _ in runs]
    prompt_tokens, cached_tokens, total = [0] * len(runs), [0] * len(runs), [0] * len(runs)
    seconds = [0.0] * len(runs)
    for turn in range(work.rounds):
        for c in range(work.conversations):
            message = [rng.randrange(vocab) for _ in range(work.turn_tokens if turn else 0)]
            for i, engine in enumerate(engines):
                history = histories[i][c]
                history += message
                start = time.perf_counter()
                rid = f"{c}.{turn}"
                ttft, tokens, cached = one_request(engine, rid, history, work.output_tokens)
                seconds[i] += time.perf_counter() - start
                history += tokens
                total[i] += len(history)
                if turn:  # the first round is cold for every configuration
                    ttfts[i].append(ttft)
                    prompt_tokens[i] += len(history) - len(tokens)
                    cached_tokens[i] += cached
    for engine in engines:
        engine.close()
    return [
        Result(label, ttfts[i], prompt_tokens[i], cached_tokens[i], total[i], seconds[i])
        for i, (label, _) in enumerate(runs)
    ]


def restart(config: EngineConfig, work: KVTiersWorkload, directory: str) -> None:
    from engine.engine import LLMEngine

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
    with tempfile.TemporaryDirectory(prefix="folio-bench-kv-tiers-") as directory:
        runs = (
            ("no tier", config),
            ("host tier (int8)", dataclasses.replace(config, kv_offload_gib=1.0)),
            (
                "host tier (native)",
                dataclasses.replace(config, kv_offload_gib=1.0, kv_offload_format="native"),
            ),
            ("disk tier", dataclasses.replace(config, kv_cache_dir=directory + "/multi-turn")),
            # The ceiling: what no tier can beat, a pool that never evicts (each
            # conversation's partial blocks besides its full ones).
            (
                "pool holding all (ceiling)",
                dataclasses.replace(
                    config,
                    num_kv_blocks=working // config.block_size + 2 * work.conversations,
                ),
            ),
        )
        results = multi_turn(list(runs), work)
        for result in results:
            print(result.line(), flush=True)
        base = statistics.median(results[0].ttfts)
        for result in results[1:]:
            print(
                f"TTFT p50 no tier / {result.label}: {base / statistics.median(result.ttfts):.2f}x"
            )
        # Restart: a pool that holds the system prompt.
        restart_blocks = 2 * (work.system_tokens + 64) // config.block_size
        restart_config = dataclasses.replace(config, num_kv_blocks=restart_blocks)
        restart(restart_config, work, directory + "/restart")
