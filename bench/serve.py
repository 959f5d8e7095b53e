"""`folio bench serve`: the served stack (HTTP gateway -> gRPC -> engine) against the engine in
this process, on one workload.

Starts a `folio serve` on free ports (or attaches to one with --url), drives the gateway's
/v1/completions with N concurrent streaming clients (a sweep, default 1 and 32) or at a Poisson
request rate, and reports TTFT, TPOT and ITL (p50, p90, p99) and request and token throughput,
and, for a stack it started, the CPU time the gateway and the tokenizer spent per output token
(from /proc: user + system time of the process and its children, all threads). With
--gateway-workers 1,2 it starts one stack per number of gateway worker processes, runs the
sweep on each and compares their throughput. Then it runs the same requests on
engine.async_engine in this process and prints the gateway / in-process throughput ratio at each
concurrency and the TTFT the service hops add at concurrency 1 (p50). A benchmark, not a test:
it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from common import event_loop

# Runs one request, (request id, prompt token ids, output length), and times it.
Client = Callable[[str, list[int], int], Awaitable["Sample"]]


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--url", default=None, help="attach to this running `folio serve` instead of starting one"
    )
    g.add_argument("--concurrency", default="1,32", help="concurrent streaming clients, a sweep")
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second instead of the concurrency sweep",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per run (default: 4 x concurrency, at least 8; 64 with --request-rate)",
    )
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--workload-seed", type=int, default=1234)
    g.add_argument("--skip-in-process", action="store_true", help="measure the served stack only")
    g.add_argument(
        "--gateway-workers",
        default="1",
        help="gateway processes of the stack it starts (folio serve --gateway-workers), a "
        "sweep: one stack for each",
    )


@dataclass
class Sample:
    """One streamed request: when it started and when each output token arrived."""

    start: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_tokens - 1)


def _stat_fields(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat") as stat:
        # The command name (field 2) may hold spaces: count fields after its closing ")".
        return stat.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process and its live children (a gateway's workers),
    all their threads (/proc/<pid>/stat)."""
    fields = _stat_fields(pid)
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = 0.0
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(_stat_fields(entry)[1]) == pid:
                children += cpu_seconds(int(entry))
        except OSError:
            continue  # gone meanwhile
    return own + children


@dataclass
class RunResult:
    label: str
    samples: list[Sample]
    seconds: float
    # Milliseconds of CPU per output token, by process name (gateway, tokenizer).
    cpu_ms_per_token: dict[str, float] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def token_throughput(self) -> float:
        return self.output_tokens / self.seconds

    def percentiles(self, values: list[float]) -> tuple[float, float, float]:
        import numpy as np

        p50, p90, p99 = (1000 * float(v) for v in np.percentile(values, [50, 90, 99]))
        return p50, p90, p99

    def ttft(self) -> tuple[float, float, float]:
        return self.percentiles([s.ttft for s in self.samples])

    def report(self) -> str:
        tpot = [t for s in self.samples if (t := s.tpot) is not None]
        itl = [
            b - a
            for s in self.samples
            for a, b in zip(s.token_times, s.token_times[1:], strict=False)
        ]
        fmt = lambda p: "/".join(f"{v:.1f}" for v in p)  # noqa: E731
        cpu = "".join(
            f"   CPU/token {name} {ms:.3f} ms" for name, ms in self.cpu_ms_per_token.items()
        )
        return (
            f"{self.label:<24} {len(self.samples) / self.seconds:6.2f} req/s "
            f"{self.token_throughput:7.1f} tok/s   TTFT {fmt(self.ttft())}   "
            f"TPOT {fmt(self.percentiles(tpot))}   ITL {fmt(self.percentiles(itl))}{cpu}"
        )


def make_prompts(
    args: argparse.Namespace, count: int, vocab_size: int, run: str, num_special: int = 32
) -> list[list[int]]:
    """Random prompts of their own for each run (`run` names it): a run must not find its
    prompts in the prefix cache because the warm-up or an earlier run sent them."""
    rng = random.Random(f"{args.workload_seed}-{run}")
    return [
        [rng.randrange(num_special, vocab_size) for _ in range(args.prompt_len)]
        for _ in range(count)
    ]


async def drive(
    client: Client,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int | None,
    rate: float | None,
    seed: int,
) -> tuple[list[Sample], float]:
    """Run every prompt through `client`, `concurrency` at a time or at Poisson `rate` per
    second."""
    limit = asyncio.Semaphore(concurrency or len(prompts))
    arrivals = random.Random(seed)

    async def one(i: int, prompt: list[int], delay: float) -> Sample:
        await asyncio.sleep(delay)
        async with limit:
            return await client(f"bench-{i}", prompt, output_len)

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if rate:
            t += arrivals.expovariate(rate)
    start = time.perf_counter()
    samples = await asyncio.gather(
        *(one(i, p, d) for i, (p, d) in enumerate(zip(prompts, delays, strict=False)))
    )
    return list(samples), time.perf_counter() - start


def http_client(session, url: str, model: str) -> Client:
    async def run(request_id: str, prompt: list[int], output_len: int) -> Sample:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sample = Sample(time.perf_counter())
        async with session.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("choices"):
                    sample.token_times.append(time.perf_counter())  # one event per token
                if chunk.get("usage"):
                    sample.num_tokens = chunk["usage"]["completion_tokens"]
        return sample

    return run


def engine_client(engine) -> Client:
    from common.sampling_params import SamplingParams
    from engine.async_engine import RequestFailed

    async def run(request_id: str, prompt: list[int], output_len: int) -> Sample:
        events: asyncio.Queue = asyncio.Queue()
        sample = Sample(time.perf_counter())
        engine.add_request(
            request_id,
            prompt,
            SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
            events,
        )
        while True:
            for event in await events.get():
                if isinstance(event, RequestFailed):
                    raise event.error
                now = time.perf_counter()
                sample.token_times += [now] * len(event.new_token_ids)
                sample.num_tokens += len(event.new_token_ids)
                if event.finished:
                    return sample

    return run


def levels(args: argparse.Namespace) -> list[tuple[str, int | None, int]]:
    """(label, concurrency, number of requests) of each run."""
    if args.request_rate:
        return [(f"rate {args.request_rate:g}/s", None, args.num_requests or 64)]
    return [
        (f"c={c}", c, args.num_requests or max(8, 4 * c))
        for c in (int(c) for c in args.concurrency.split(","))
    ]


async def bench_levels(
    name: str,
    client: Client,
    args: argparse.Namespace,
    vocab_size: int,
    pids: dict[str, int] | None = None,
) -> dict[str, RunResult]:
    """Each run of the sweep; `pids` (name -> process id) get their CPU time per output token
    measured over each run."""
    results = {}
    pids = pids or {}
    await drive(client, make_prompts(args, 2, vocab_size, "warm-up"), 8, 2, None, 0)
    for label, concurrency, count in levels(args):
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        samples, seconds = await drive(
            client,
            make_prompts(args, count, vocab_size, label),
            args.output_len,
            concurrency,
            args.request_rate,
            args.workload_seed,
        )
        result = RunResult(f"{name} {label}", samples, seconds)
        result.cpu_ms_per_token = {
            name: 1000 * (cpu_seconds(pid) - cpu_before[name]) / result.output_tokens
            for name, pid in pids.items()
        }
        results[label] = result
        print(result.report(), flush=True)
    return results


async def bench_gateway(
    url: str,
    args: argparse.Namespace,
    vocab_size: int,
    pids: dict[str, int] | None = None,
    name: str = "gateway",
) -> dict[str, RunResult]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as session:
        model = (await session.get(f"{url}/v1/models")).json()["data"][0]["id"]
        return await bench_levels(name, http_client(session, url, model), args, vocab_size, pids)


async def bench_in_process(config, args: argparse.Namespace) -> dict[str, RunResult]:
    from engine.async_engine import AsyncEngine
    from engine.engine import LLMEngine

    engine = AsyncEngine(lambda: LLMEngine(config))
    await asyncio.wrap_future(engine.start())
    assert engine.engine is not None  # start() built it
    try:
        return await bench_levels(
            "in-process", engine_client(engine), args, engine.engine.vocab_size
        )
    finally:
        engine.shutdown()


def _vocab_size(config) -> int:
    from common.default_model import resolve_model_path
    from engine.models.config import ModelConfig

    return ModelConfig.from_dir(resolve_model_path(config.model)).vocab_size


def serve_and_bench(
    config, args: argparse.Namespace, vocab_size: int, gateway_workers: int
) -> dict[str, RunResult]:
    """Start a `folio serve` with `gateway_workers` gateway processes, run the sweep, stop it."""
    from services.supervisor import ServeConfig, Supervisor

    with tempfile.NamedTemporaryFile(
        "w", prefix="folio-bench-serve-", suffix=".log", delete=False
    ) as log:
        supervisor = Supervisor(
            ServeConfig(
                port=0,
                grpc_port=0,
                engine_port=0,
                tokenizer_port=0,
                gateway_workers=gateway_workers,
                engine=config,
            ),
            output=log,
        )
        print(
            f"starting folio serve --gateway-workers {gateway_workers} (service logs in "
            f"{log.name})",
            flush=True,
        )
        try:
            supervisor.start()
            pids = {
                child.name: child.process.pid
                for child in (supervisor.gateway, supervisor.tokenizer)
                if child.process is not None
            }
            name = "gateway" if gateway_workers == 1 else f"gateway x{gateway_workers}"
            return event_loop.run(bench_gateway(supervisor.url, args, vocab_size, pids, name))
        finally:
            supervisor.stop()  # frees the cores for the next run


def compare_workers(by_workers: dict[int, dict[str, RunResult]]) -> None:
    """Each run's token throughput with each number of gateway workers, against the first."""
    if len(by_workers) < 2:
        return
    (first, base), *others = by_workers.items()
    for label, result in base.items():
        figures = [
            f"{first} worker{'s' if first > 1 else ''} {result.token_throughput:.1f} tok/s"
        ] + [
            f"{workers} workers {runs[label].token_throughput:.1f} tok/s "
            f"(x{runs[label].token_throughput / result.token_throughput:.2f})"
            for workers, runs in others
        ]
        print(f"gateway throughput at {label}: " + ", ".join(figures))


def run_serve_benchmark(args: argparse.Namespace) -> None:
    from common.config import engine_config_from_args

    config = engine_config_from_args(args)
    vocab_size = _vocab_size(config)
    print(
        f"workload: prompts of {args.prompt_len} random tokens, {args.output_len} output tokens, "
        f"greedy, ignore_eos; runs: " + ", ".join(f"{label} x {n}" for label, _, n in levels(args))
    )
    print("TTFT, TPOT and ITL in ms as p50/p90/p99", flush=True)
    if args.url:
        served = event_loop.run(bench_gateway(args.url.rstrip("/"), args, vocab_size))
    else:
        by_workers = {
            workers: serve_and_bench(config, args, vocab_size, workers)
            for workers in (int(w) for w in args.gateway_workers.split(","))
        }
        served = next(iter(by_workers.values()))
        compare_workers(by_workers)
    if "c=32" in served and "gateway" in served["c=32"].cpu_ms_per_token:
        print(
            f"gateway CPU per output token at c=32: "
            f"{served['c=32'].cpu_ms_per_token['gateway']:.3f} ms (target <= 0.15 ms)"
        )
    if args.skip_in_process:
        return
    local = event_loop.run(bench_in_process(config, args))
    labels = list(served)
    first = labels[0]
    # The targets: throughput at least 95% of in-process at c=32 and 90% at c=128, TTFT at c=1.
    sweep = args.request_rate is None
    targets = {"c=32": 0.95, "c=128": 0.90} if sweep else {}
    for label in labels:
        target = f" (target >= {targets[label]:.2f})" if label in targets else ""
        print(
            f"throughput gateway/in-process at {label}: "
            f"{served[label].token_throughput / local[label].token_throughput:.2f}{target}"
        )
    added = served[first].ttft()[0] - local[first].ttft()[0]
    print(
        f"TTFT added by the service hops at {first}, p50: {added:.1f} ms"
        + (" (target <= 10 ms)" if sweep else "")
    )
