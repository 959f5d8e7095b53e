"""`folio bench routing`: a multi-turn chat workload with shared system prompts against N engine
replicas behind one gateway, once per routing policy, each on a fresh stack (cold caches).

Per policy it prints the prefix-cache hit rate (prompt tokens found in the engines' caches),
TTFT p50/p99 as the client sees it (streamed chat completions), throughput, and how evenly the
requests spread over the replicas (the busiest replica's share against the mean share), then
per replica (the gateway's series by their `replica` label) the requests routed to it and its
hit rate. Real replicas run under `folio serve --engine-replicas N`; simulated ones (--simulate)
in one `folio engine --simulate --replicas N` process beside a tokenizer and a gateway, each
started with its config dataclass's flags (common.flags.command_line), and then the
share of the modelled step time the simulated steps overran (the machine's CPU deciding rather
than the model) is printed too. A one-engine run of the same workload gives the hit rate to
compare with. Targets, printed as ratios from the same run: cache_aware's TTFT p99 at most 1.1x
round_robin's, its hit rate at least 95% of one engine's. Conversations arrive as a Poisson
process at the offered request rate; each next turn is sent when the previous answer is complete
and quotes it.

A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from common.config import (
    ROUTING_POLICIES,
    EngineServiceConfig,
    GatewayConfig,
    GatewayFrontConfig,
    GatewayServerConfig,
    ListenConfig,
    SimulationConfig,
    StepCostConfig,
    TokenizerServiceConfig,
    engine_config_from_args,
)
from common.flags import command_line, flag
from services.supervisor import ServeConfig

SERVING = re.compile(r"serving on (http://\S+) ")
GATEWAY = re.compile(r"gateway listening on (http://\S+) ")
ENGINES = re.compile(r"simulated engines listening on (\S+):([\d,]+)")
TOKENIZER = re.compile(r"TokenizerService listening on (\S+)")


@dataclass
class RoutingWorkload:
    """Routing workload."""

    replicas: int = flag(2, "engine replicas")
    simulate: bool = flag(False, "simulated engines (engine/simulated.py)")
    policies: str = flag(",".join(ROUTING_POLICIES), "comma-separated policies")
    conversations: int = flag(200, "multi-turn conversations")
    min_turns: int = flag(4, "fewest turns of a conversation")
    max_turns: int = flag(8, "most turns of a conversation")
    system_prompts: int = flag(8, "distinct system prompts the conversations share")
    system_tokens: int = flag(256, "tokens of a system prompt")
    user_tokens: int = flag(48, "tokens of a user turn")
    output_tokens: int = flag(48, "tokens of an answer")
    rate_per_replica: float | None = flag(
        None, "offered requests/s per replica (default: 1 real, 4 simulated)"
    )
    workload_seed: int = flag(0, "seed of the conversations")
    skip_single: bool = flag(False, "skip the one-engine run whose hit rate is the reference")
    startup_timeout: float = flag(600.0, "seconds to wait for a stack")


# -- the workload ------------------------------------------------------------------------------


@dataclass
class Conversation:
    system: str
    user_turns: list[str]
    start: float  # seconds after the run's start


def _words_of(tokenizer, rng: random.Random, vocabulary: list[str], num_tokens: int) -> str:
    """Text of about `num_tokens` tokens, from random common words."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < num_tokens:
        words += rng.choices(vocabulary, k=max(1, (num_tokens - len(words)) // 2))
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > num_tokens:
        words.pop()
    return " ".join(words)


VOCABULARY = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "are",
    "this",
    "be",
    "or",
    "an",
    "which",
    "they",
    "had",
    "not",
    "were",
    "have",
    "their",
    "one",
    "all",
    "would",
    "there",
    "been",
    "has",
    "when",
    "who",
    "more",
    "will",
    "if",
    "no",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
]


def make_workload(args: argparse.Namespace, tokenizer, rate: float) -> list[Conversation]:
    rng = random.Random(args.workload_seed)
    systems = [
        _words_of(tokenizer, rng, VOCABULARY, args.system_tokens)
        for _ in range(args.system_prompts)
    ]
    mean_turns = (args.min_turns + args.max_turns) / 2
    conversation_rate = rate / mean_turns
    start = 0.0
    conversations = []
    for _ in range(args.conversations):
        start += rng.expovariate(conversation_rate)
        turns = rng.randint(args.min_turns, args.max_turns)
        conversations.append(
            Conversation(
                rng.choice(systems),
                [_words_of(tokenizer, rng, VOCABULARY, args.user_tokens) for _ in range(turns)],
                start,
            )
        )
    return conversations


# -- the client --------------------------------------------------------------------------------


@dataclass
class Results:
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0
    requests: int = 0
    failures: int = 0
    seconds: float = 0.0


async def _turn(client, url: str, model: str, messages: list[dict], args, results: Results):
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": args.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    text: list[str] = []
    first: float | None = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        if first is None:
                            first = time.perf_counter()
                        text.append(delta)
                if chunk.get("usage"):
                    results.output_tokens += chunk["usage"]["completion_tokens"]
    except Exception as exc:
        results.failures += 1
        print(f"  request failed: {exc}", file=sys.stderr)
        return None
    results.requests += 1
    if first is not None:
        results.ttfts.append(first - sent)
    return "".join(text)


async def _conversation(client, url, model, conversation: Conversation, args, results, t0):
    await asyncio.sleep(max(0.0, t0 + conversation.start - time.perf_counter()))
    messages = [{"role": "system", "content": conversation.system}]
    for user in conversation.user_turns:
        messages.append({"role": "user", "content": user})
        answer = await _turn(client, url, model, messages, args, results)
        if answer is None:
            return
        messages.append({"role": "assistant", "content": answer})


async def _drive(url: str, conversations: list[Conversation], args) -> Results:
    import httpx

    results = Results()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        await asyncio.gather(
            *(_conversation(client, url, model, c, args, results, t0) for c in conversations)
        )
        results.seconds = time.perf_counter() - t0
    return results


# -- the stacks --------------------------------------------------------------------------------


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


class _Process:
    """A child `folio` process whose output goes to a file, waited for by a regex."""

    def __init__(self, args: list[str], env: dict[str, str], log_dir: Path, name: str) -> None:
        self.log = log_dir / f"{name}.log"
        self._file = self.log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "folio.cli", *args],
            stdout=self._file,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = pattern.search(self.log.read_text(errors="replace"))
            if match:
                return match
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"{self.log} shows no {pattern.pattern!r}:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._file.close()


def _listen() -> ListenConfig:
    """Any free port; a stack stops at once."""
    return ListenConfig(port=0, drain_seconds=1.0)


def _front(policy: str) -> GatewayFrontConfig:
    return GatewayFrontConfig(
        listen=_listen(), grpc_port=0, policy=GatewayConfig(routing_policy=policy)
    )


@contextlib.contextmanager
def _stack(args: argparse.Namespace, policy: str, replicas: int, log_dir: Path) -> Iterator[str]:
    """A gateway over `replicas` engines; yields its URL. Each process's command line is its
    config dataclass's (common.flags.command_line), as a user would start it."""
    engine = engine_config_from_args(args)
    env = {**os.environ, "FOLIO_INTERNAL_TOKEN": "", "FOLIO_API_KEYS": ""}
    processes: list[_Process] = []
    try:
        if not args.simulate:
            serve = ServeConfig(
                front=_front(policy),
                engine_port=0,
                tokenizer_port=0,
                engine_replicas=replicas,
                startup_timeout=args.startup_timeout,
                engine=engine,
            )
            process = _Process(
                ["serve", *command_line(serve)], env, log_dir, f"serve-{policy}-{replicas}"
            )
            processes.append(process)
            yield process.wait_for(SERVING, args.startup_timeout)[1]
            return
        simulated = EngineServiceConfig(
            listen=_listen(),
            engine=engine,
            simulation=SimulationConfig(
                simulate=True, replicas=replicas, cost=StepCostConfig(Path(args.step_cost))
            ),
            generate_socket_port=0,
        )
        engines = _Process(["engine", *command_line(simulated)], env, log_dir, f"engines-{policy}")
        tokenizer_config = TokenizerServiceConfig(model=engine.model, listen=_listen())
        tokenizer = _Process(
            ["tokenizer", *command_line(tokenizer_config)], env, log_dir, "tokenizer"
        )
        processes += [engines, tokenizer]
        host, ports = engines.wait_for(ENGINES, args.startup_timeout).groups()
        gateway_config = GatewayServerConfig(
            front=_front(policy),
            engine_address=tuple(f"{host}:{port}" for port in ports.split(",")),
            tokenizer_address=tokenizer.wait_for(TOKENIZER, args.startup_timeout)[1],
        )
        gateway = _Process(
            ["gateway", *command_line(gateway_config)], env, log_dir, f"gateway-{policy}"
        )
        processes.append(gateway)
        url = gateway.wait_for(GATEWAY, args.startup_timeout)[1]
        import httpx

        deadline = time.monotonic() + args.startup_timeout
        while httpx.get(url + "/health", timeout=60).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway never became healthy")
            time.sleep(0.2)
        yield url
    finally:
        for process in reversed(processes):
            process.stop()


# -- the report --------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run_one(args, policy: str, replicas: int, conversations, log_dir: Path) -> dict:
    with _stack(args, policy, replicas, log_dir) as url:
        results = asyncio.run(_drive(url, conversations, args))
        metrics = _metrics(url)
    hits = metrics.get(("folio_prefix_cache_hits_total", ()), 0.0)
    queries = metrics.get(("folio_prefix_cache_queries_total", ()), 0.0)
    by_replica = _per_replica(metrics, "folio_replica_requests_routed_total")
    routed = list(by_replica.values()) or [float(results.requests)]
    mean = sum(routed) / len(routed)
    replica_hits = _per_replica(metrics, "folio_replica_prefix_cache_hits_total")
    replica_queries = _per_replica(metrics, "folio_replica_prefix_cache_queries_total")
    detail = ", ".join(
        f"{replica} routed {count:.0f}, hit rate "
        f"{_ratio(replica_hits.get(replica, 0.0), replica_queries.get(replica, 0.0)) * 100:.1f}%"
        for replica, count in sorted(by_replica.items())
    )
    modelled = metrics.get(("folio_engine_step_seconds_total", (("phase", "forward"),)), 0.0)
    overrun = metrics.get(("folio_engine_step_seconds_total", (("phase", "overrun"),)), None)
    return {
        "policy": policy if replicas > 1 else "(one engine)",
        "replicas": replicas,
        "hit_rate": _ratio(hits, queries),
        "ttft_p50": statistics.median(results.ttfts) if results.ttfts else float("nan"),
        "ttft_p99": _percentile(results.ttfts, 0.99),
        "requests_per_s": results.requests / results.seconds,
        "tokens_per_s": results.output_tokens / results.seconds,
        "max_share": max(routed) / mean if mean else float("nan"),
        "failures": results.failures,
        "overrun": None if overrun is None or not modelled else overrun / modelled,
        "replicas_detail": detail if replicas > 1 else "",
    }


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else float("nan")


def _per_replica(metrics: dict, sample: str) -> dict[str, float]:
    """A per-replica series' values by its `replica` label (the engine's address)."""
    return {
        labels["replica"]: value
        for (name, label_items), value in metrics.items()
        if name == sample and "replica" in (labels := dict(label_items))
    }


def run_routing_benchmark(args: argparse.Namespace) -> None:
    from common.default_model import resolve_model_path
    from common.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_path(args.model))
    rate = args.rate_per_replica or (4.0 if args.simulate else 1.0)
    policies = [p for p in args.policies.split(",") if p]
    conversations = make_workload(args, tokenizer, rate * args.replicas)
    turns = sum(len(c.user_turns) for c in conversations)
    kind = "simulated" if args.simulate else "real"
    print(
        f"{args.conversations} conversations ({turns} requests), {args.system_prompts} system "
        f"prompts of {args.system_tokens} tokens, user turns of {args.user_tokens} tokens, "
        f"{args.output_tokens} generated tokens per turn, Poisson arrivals at {rate:g} "
        f"requests/s per replica; {args.replicas} {kind} replicas, KV pool of "
        f"{args.num_kv_blocks} blocks of {args.block_size} tokens each",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="folio-bench-routing-") as tmp:
        log_dir = Path(tmp)
        runs = [(p, args.replicas) for p in policies]
        if not args.skip_single:
            runs.insert(0, ("round_robin", 1))
        for policy, replicas in runs:
            row = _run_one(args, policy, replicas, conversations, log_dir)
            rows.append(row)
            print(_format(row), flush=True)
            if row["replicas_detail"]:
                print(f"  per replica: {row['replicas_detail']}", flush=True)
    print("\nsummary:")
    print(
        f"  {'policy':14s} {'hit rate':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'req/s':>7s} "
        f"{'tok/s':>7s} {'max/mean share':>15s}"
    )
    for row in rows:
        print("  " + _format(row))
    by_policy = {row["policy"]: row for row in rows}
    cache_aware, round_robin = by_policy.get("cache_aware"), by_policy.get("round_robin")
    single = by_policy.get("(one engine)")
    if cache_aware and round_robin:
        ratio = cache_aware["ttft_p99"] / round_robin["ttft_p99"]
        print(f"cache_aware's TTFT p99 is {ratio:.2f}x round_robin's (target: at most 1.1x)")
    if cache_aware and single:
        share = cache_aware["hit_rate"] / single["hit_rate"]
        print(f"cache_aware's hit rate is {share * 100:.0f}% of one engine's (target: >= 95%)")


def _format(row: dict) -> str:
    text = (
        f"{row['policy']:14s} {row['hit_rate'] * 100:8.1f}% {row['ttft_p50'] * 1e3:7.0f}ms "
        f"{row['ttft_p99'] * 1e3:7.0f}ms {row['requests_per_s']:7.2f} {row['tokens_per_s']:7.1f} "
        f"{row['max_share']:15.2f}"
    )
    if row["failures"]:
        text += f"  ({row['failures']} failed)"
    if row["overrun"] is not None:
        text += f"  steps overran the model by {row['overrun'] * 100:.1f}%"
    return text
