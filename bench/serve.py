"""`folio bench serve`: the served stack (HTTP gateway -> gRPC -> engine) against the engine in
this process, on one workload.

Starts a `folio serve` on free ports (or attaches to one with --url), drives the gateway's
/v1/completions with N concurrent streaming clients (a sweep, default 1 and 32) or at a Poisson
request rate, and reports TTFT, TPOT and ITL (p50, p90, p99) and request and token throughput,
the CPU time its own client spent per output token (bench.sse_client: it runs on the server's
cores), and, for a stack it started, the gateway's and the tokenizer's (from /proc: user +
system time of the process and its children, all threads) and the engine process's beside its
steps (its event loop and gRPC's threads: every thread but the engine loop's and OpenMP's
workers, which it names). With
--gateway-workers 1,2 it starts one stack per number of gateway worker processes, runs the
sweep on each and compares their throughput. With --compare-url it runs the same workload on
another OpenAI-compatible server (llama.cpp's llama-server, say) and prints Folio / peer ratios of
tok/s and the p50 TTFT and TPOT at each concurrency: both get the same text prompts (the random
token prompts decoded with the model's tokenizer), max_tokens, ignore_eos and --temperature (0,
greedy, by default: above it the sampler's draws count too), and a server that
streams no usage has its tokens counted one per non-empty chunk; a server that ended a request
before the output length (it ignored ignore_eos) is reported. Then it runs the same requests
(as token ids) on engine.async_engine in this process and prints the gateway / in-process
throughput ratio at each concurrency, the decode speed ratio (1 / TPOT) at concurrency 1 and the
TTFT the service hops add there (p50). The in-process engine runs beside the started stack (idle
meanwhile), so that with --repeats N the sweeps (served, the peer's, in-process) take turns N
times, each turn with prompts of its own, and each level's figures pool the turns: a VM's speed
drifts by tens of percent within minutes, and a ratio of two runs minutes apart measures the
drift. Both engines start with their compiled decode programs (--decode-compile auto is startup
here), so no run is partly eager.
A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from bench.sse_client import SSEClient
from common import event_loop
from common.flags import flag, from_args

# A prompt as token ids, or as text for a server that takes no token ids.
Prompt = list[int] | str
# Runs one request, (request id, prompt, output length), and times it.
Client = Callable[[str, Prompt, int], Awaitable["Sample"]]
# The prompts of one run: (how many, the run's name) -> prompts.
PromptMaker = Callable[[int, str], list[Prompt]]


@dataclass
class ServeWorkload:
    """Workload."""

    url: str | None = flag(
        None, "attach to this running `folio serve` (default: start one for the run)"
    )
    concurrency: str = flag("1,32", "concurrent streaming clients, a sweep")
    request_rate: float | None = flag(
        None, "Poisson arrivals per second (default: none, the concurrency sweep)"
    )
    num_requests: int | None = flag(
        None, "requests per run (default: 4 x concurrency, at least 8; 64 with --request-rate)"
    )
    prompt_len: int = flag(128, "prompt length, in tokens")
    output_len: int = flag(64, "output length, in tokens")
    temperature: float = flag(
        0.0, "sampling temperature of every request (0: greedy; above, the sampler's draws count)"
    )
    workload_seed: int = flag(1234, "seed of the prompts")
    skip_in_process: bool = flag(False, "measure the served stack only")
    repeats: int = flag(
        1,
        "the served stack's sweep, --compare-url's and the in-process one take turns this many "
        "times, each turn with prompts of its own, and each level's figures pool the turns: a "
        "drift in the machine's speed (other tenants of a VM) then weighs on every side alike",
    )
    gateway_workers: str = flag(
        "1",
        "gateway processes of the stack it starts (folio serve --gateway-workers), a sweep: "
        "one stack for each",
    )
    compare_url: str | None = flag(
        None,
        "also run the workload on this OpenAI-compatible server (e.g. llama-server) and print "
        "Folio / it ratios; both then get text prompts (default: none)",
    )
    compare_model: str | None = flag(
        None, "model name sent to --compare-url (default: the first id of its /v1/models)"
    )

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")


@dataclass
class Sample:
    """One streamed request: when it started and when each output token arrived."""

    start: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    # Told by the server's usage; None where it streams none (tokens are then counted by chunk).
    prompt_tokens: int | None = None
    # Speculative tokens a peer drafted and accepted for it, where it tells them (llama-server).
    drafted: int = 0
    accepted: int = 0

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


def service_cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of an engine service's live threads other than its engine
    steps' (named engine.async_engine.STEP_THREAD_NAME, OpenMP's workers included): its event
    loop and gRPC's threads, what serving costs beside the model (/proc/<pid>/task)."""
    from engine.async_engine import STEP_THREAD_NAME

    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                if comm.read().strip() == STEP_THREAD_NAME:
                    continue
            fields = _stat_fields(f"{pid}/task/{tid}")
        except OSError:
            continue  # gone meanwhile
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


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

    def tpot(self) -> tuple[float, float, float]:
        return self.percentiles([t for s in self.samples if (t := s.tpot) is not None])

    def joined(self, other: RunResult, label: str) -> RunResult:
        """This run and `other` (the same level, another turn) as one: their samples and
        seconds added, CPU per token weighted by each run's tokens."""
        tokens = self.output_tokens + other.output_tokens
        cpu = {
            name: (ms * self.output_tokens + other.cpu_ms_per_token[name] * other.output_tokens)
            / tokens
            for name, ms in self.cpu_ms_per_token.items()
        }
        return RunResult(label, self.samples + other.samples, self.seconds + other.seconds, cpu)

    def report(self) -> str:
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
            f"TPOT {fmt(self.tpot())}   ITL {fmt(self.percentiles(itl))}{cpu}"
        )


def token_prompts(args: argparse.Namespace, vocab_size: int, num_special: int = 32) -> PromptMaker:
    """Random prompts of their own for each run (`run` names it): a run must not find its
    prompts in the prefix cache because the warm-up or an earlier run sent them."""

    def make(count: int, run: str) -> list[Prompt]:
        rng = random.Random(f"{args.workload_seed}-{run}")
        return [
            [rng.randrange(num_special, vocab_size) for _ in range(args.prompt_len)]
            for _ in range(count)
        ]

    return make


def text_prompts(args: argparse.Namespace, tokenizer) -> PromptMaker:
    """The same random prompts as text, for servers that take no token ids: decoded, encoded
    again and cut at the prompt length (random tokens decode to text that encodes differently),
    so any server with this tokenizer sees about `prompt_len` tokens."""
    ids = token_prompts(args, tokenizer.vocab_size)

    def make(count: int, run: str) -> list[Prompt]:
        return [
            tokenizer.decode(
                tokenizer.encode(tokenizer.decode(prompt), add_special_tokens=False)[
                    : args.prompt_len
                ]
            )
            for prompt in ids(count, run)
        ]

    return make


async def drive(
    client: Client,
    prompts: list[Prompt],
    output_len: int,
    concurrency: int | None,
    rate: float | None,
    seed: int,
) -> tuple[list[Sample], float]:
    """Run every prompt through `client`, `concurrency` at a time or at Poisson `rate` per
    second."""
    limit = asyncio.Semaphore(concurrency or len(prompts))
    arrivals = random.Random(seed)

    async def one(i: int, prompt: Prompt, delay: float) -> Sample:
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


def http_client(
    session: SSEClient, url: str, model: str, ignore_eos: bool = True, temperature: float = 0.0
) -> Client:
    """Streams `url`'s /v1/completions through `session` (server_session's). Asks for exactly
    `output_len` tokens (max_tokens and ignore_eos, which llama-server and vLLM honour too; at
    most that many without ignore_eos) and usage in the stream; a chunk with text is a token
    arriving, and where no usage comes (llama-server without include_usage support, say) the
    tokens are those chunks. llama-server's drafted and accepted tokens (its `timings`), where
    it tells them, go into the sample too."""
    path = urlsplit(url).path.rstrip("/")

    async def run(request_id: str, prompt: Prompt, output_len: int) -> Sample:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sample = Sample(time.perf_counter())
        async for data in session.data_lines(f"{path}/v1/completions", body):
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                sample.token_times.append(time.perf_counter())  # a token's text arrived
            if usage := chunk.get("usage"):
                sample.num_tokens = usage["completion_tokens"]
                sample.prompt_tokens = usage.get("prompt_tokens")
            if timings := chunk.get("timings"):
                sample.drafted = timings.get("draft_n", sample.drafted)
                sample.accepted = timings.get("draft_n_accepted", sample.accepted)
        if not sample.token_times:
            raise RuntimeError(f"{url} streamed no text for {request_id}")
        if not sample.num_tokens:
            sample.num_tokens = len(sample.token_times)
        return sample

    return run


def engine_client(engine, temperature: float = 0.0) -> Client:
    from common.sampling_params import SamplingParams
    from engine.async_engine import RequestFailed

    async def run(request_id: str, prompt: Prompt, output_len: int) -> Sample:
        assert isinstance(prompt, list), "the engine takes token ids"
        events: asyncio.Queue = asyncio.Queue()
        sample = Sample(time.perf_counter())
        engine.add_request(
            request_id,
            prompt,
            SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True),
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
    prompts: PromptMaker,
    meters: dict[str, Callable[[], float]] | None = None,
    turn: int = 0,
) -> dict[str, RunResult]:
    """Each run of the sweep; `meters` (name -> CPU seconds so far, of a process or part of
    one) get their CPU time per output token measured over each run. Says which requests
    ended before the output length. A later `turn` (--repeats) has prompts of its own."""
    results = {}
    meters = meters or {}
    if turn == 0:
        await drive(client, prompts(2, "warm-up"), 8, 2, None, 0)
    for label, concurrency, count in levels(args):
        cpu_before = {name: meter() for name, meter in meters.items()}
        samples, seconds = await drive(
            client,
            prompts(count, label if turn == 0 else f"{label} turn {turn}"),
            args.output_len,
            concurrency,
            args.request_rate,
            args.workload_seed,
        )
        result = RunResult(f"{name} {label}", samples, seconds)
        result.cpu_ms_per_token = {
            name: 1000 * (meter() - cpu_before[name]) / result.output_tokens
            for name, meter in meters.items()
        }
        results[label] = result
        print(result.report(), flush=True)
        if short := [s.num_tokens for s in samples if s.num_tokens < args.output_len]:
            print(
                f"{name} {label}: {len(short)} of {len(samples)} requests ended before "
                f"{args.output_len} tokens (fewest {min(short)}): the server ignored ignore_eos "
                "(or streamed several tokens a chunk and no usage); its figures count what came",
                flush=True,
            )
    return results


async def bench_gateway(
    url: str,
    args: argparse.Namespace,
    prompts: PromptMaker,
    meters: dict[str, Callable[[], float]] | None = None,
    name: str = "gateway",
    model: str | None = None,
    turn: int = 0,
) -> dict[str, RunResult]:
    """The sweep on an OpenAI-compatible server at `url`: Folio's gateway or a peer. The
    client's own CPU (this process's) is metered too: it shares the server's cores."""
    meters = {**(meters or {}), "client": time.process_time}
    async with server_session(url, model, peer=name != "gateway") as (session, model):
        client = http_client(session, url, model, temperature=args.temperature)
        return await bench_levels(name, client, args, prompts, meters, turn)


@contextlib.asynccontextmanager
async def server_session(
    url: str, model: str | None, peer: bool
) -> AsyncIterator[tuple[SSEClient, str]]:
    """A streaming client of the server at `url` (bench.sse_client: lean, as the client shares
    the server's cores) and the model name to send (`model`, else the first id of its
    /v1/models). A peer gets a new connection per request (SSEClient's keep_alive)."""
    if model is None:
        import httpx

        async with httpx.AsyncClient(timeout=600) as session:
            model = (await session.get(f"{url}/v1/models")).json()["data"][0]["id"]
    client = SSEClient(url, keep_alive=not peer)
    try:
        yield client, model
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def in_process_engine(config) -> AsyncIterator:
    """An engine.async_engine.AsyncEngine of `config` in this process, started."""
    from engine.async_engine import AsyncEngine
    from engine.engine import LLMEngine

    engine = AsyncEngine(lambda: LLMEngine(config))
    await asyncio.wrap_future(engine.start())
    assert engine.engine is not None  # start() built it
    try:
        yield engine
    finally:
        engine.shutdown()


# One side's sweep in a given turn (0, 1, ... --repeats - 1).
Sweep = Callable[[int], Awaitable[dict[str, RunResult]]]


async def take_turns(sweeps: list[Sweep], repeats: int) -> list[dict[str, RunResult]]:
    """Each sweep `repeats` times, in turn (A B A B ...), and each sweep's runs of a level
    pooled: their ratio is then measured over the same stretch of time."""
    pooled: list[dict[str, RunResult]] = [{} for _ in sweeps]
    for turn in range(repeats):
        for sweep, results in zip(sweeps, pooled, strict=True):
            for label, result in (await sweep(turn)).items():
                first = results.get(label)
                name = f"{result.label} ({repeats} turns)"
                results[label] = result if first is None else first.joined(result, name)
    if repeats > 1:
        for results in pooled:
            for result in results.values():
                print(result.report(), flush=True)
    return pooled


def peer_name(args: argparse.Namespace) -> str:
    """How the report names --compare-url's server: its host:port."""
    return urlsplit(args.compare_url).netloc or args.compare_url


@dataclass
class Sides:
    """Each side's runs by level: the served stack's, --compare-url's server's (None without
    one) and the in-process engine's (None with --skip-in-process)."""

    served: dict[str, RunResult]
    peer: dict[str, RunResult] | None
    local: dict[str, RunResult] | None


async def sides_in_turns(
    url: str,
    meters: dict[str, Callable[[], float]] | None,
    name: str,
    config,
    args: argparse.Namespace,
    prompts: PromptMaker,
) -> Sides:
    """The sweep on the stack at `url`, on --compare-url's server and, unless
    --skip-in-process, on an engine of the same config in this process (token id prompts),
    taking turns --repeats times."""

    def served(turn: int) -> Awaitable[dict[str, RunResult]]:
        return bench_gateway(url, args, prompts, meters, name, turn=turn)

    sweeps: dict[str, Sweep] = {"served": served}
    if args.compare_url:

        def peer(turn: int) -> Awaitable[dict[str, RunResult]]:
            return bench_gateway(
                args.compare_url.rstrip("/"),
                args,
                prompts,
                name=peer_name(args),
                model=args.compare_model,
                turn=turn,
            )

        sweeps["peer"] = peer
    async with contextlib.AsyncExitStack() as stack:
        if not args.skip_in_process:
            engine = await stack.enter_async_context(in_process_engine(config))
            client = engine_client(engine, args.temperature)
            local_prompts = token_prompts(args, engine.engine.vocab_size)

            def local(turn: int) -> Awaitable[dict[str, RunResult]]:
                return bench_levels("in-process", client, args, local_prompts, turn=turn)

            sweeps["local"] = local
        runs = dict(zip(sweeps, await take_turns(list(sweeps.values()), args.repeats), strict=True))
        return Sides(runs["served"], runs.get("peer"), runs.get("local"))


def workload_prompts(config, args: argparse.Namespace) -> PromptMaker:
    """Token ids for Folio alone; text, the same for both, when it is compared with a peer."""
    from common.default_model import resolve_model_path

    model_dir = resolve_model_path(config.model)
    if args.compare_url:
        from common.tokenizer import Tokenizer

        return text_prompts(args, Tokenizer.from_dir(model_dir))
    from engine.models.config import ModelConfig

    return token_prompts(args, ModelConfig.from_dir(model_dir).vocab_size)


@dataclass
class StartedStack:
    url: str
    name: str  # gateway, or gateway xN
    # CPU seconds so far of the gateway, the tokenizer and the engine process beside its steps.
    meters: dict[str, Callable[[], float]]


@contextlib.contextmanager
def started_stack(config, gateway_workers: int) -> Iterator[StartedStack]:
    """A `folio serve` with `gateway_workers` gateway processes, stopped on leaving."""
    from common.config import GatewayFrontConfig, ListenConfig
    from services.supervisor import ServeConfig, Supervisor

    if config.decode_compile == "auto":
        # As in this process: healthy with its compiled decode programs, so that its runs are
        # not partly eager while they load in the background.
        config = dataclasses.replace(config, decode_compile="startup")

    with tempfile.NamedTemporaryFile(
        "w", prefix="folio-bench-serve-", suffix=".log", delete=False
    ) as log:
        supervisor = Supervisor(
            ServeConfig(
                GatewayFrontConfig(ListenConfig(port=0), grpc_port=0),
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
            meters: dict[str, Callable[[], float]] = {
                child.name: functools.partial(cpu_seconds, child.process.pid)
                for child in (supervisor.gateway, supervisor.tokenizer)
                if child.process is not None
            }
            # The engine's process beside its steps: its event loop and gRPC, per token.
            for engine in supervisor.engines:
                if engine.process is not None:
                    meters[f"{engine.name} service"] = functools.partial(
                        service_cpu_seconds, engine.process.pid
                    )
            name = "gateway" if gateway_workers == 1 else f"gateway x{gateway_workers}"
            yield StartedStack(supervisor.url, name, meters)
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


@dataclass
class Figures:
    """A run's token throughput and its p50 TTFT and TPOT (ms)."""

    tok_s: float
    ttft_ms: float
    tpot_ms: float

    @classmethod
    def of(cls, result: RunResult) -> Figures:
        return cls(result.token_throughput, result.ttft()[0], result.tpot()[0])


@dataclass
class Comparison:
    """One run of the sweep on Folio and on the peer server."""

    label: str
    folio_run: RunResult
    peer_run: RunResult

    @property
    def folio(self) -> Figures:
        return Figures.of(self.folio_run)

    @property
    def peer(self) -> Figures:
        return Figures.of(self.peer_run)

    @property
    def ratio(self) -> Figures:
        """Folio / peer: above 1 is Folio ahead in tok/s, below 1 ahead in TTFT and TPOT."""
        return Figures(
            self.folio.tok_s / self.peer.tok_s,
            self.folio.ttft_ms / self.peer.ttft_ms,
            self.folio.tpot_ms / self.peer.tpot_ms,
        )


def _mean_prompt_tokens(results: dict[str, RunResult]) -> str:
    counts = [s.prompt_tokens for r in results.values() for s in r.samples]
    told = [n for n in counts if n is not None]
    if len(told) < len(counts):
        return "not told (no usage in its stream: tokens counted one per chunk with text)"
    return f"{sum(told) / len(told):.1f}"


def compare_servers(
    folio: dict[str, RunResult], peer: dict[str, RunResult], peer_name: str
) -> list[Comparison]:
    """Print each run's figures on both servers and Folio / peer; return them."""
    comparisons = [Comparison(label, result, peer[label]) for label, result in folio.items()]
    print(f"Folio vs {peer_name}, same workload (Folio / {peer_name} in brackets):")
    for c in comparisons:
        ours, theirs, ratio = c.folio, c.peer, c.ratio
        print(
            f"  {c.label:<10} tok/s {ours.tok_s:.1f} vs {theirs.tok_s:.1f} (x{ratio.tok_s:.2f})"
            f"   TTFT p50 {ours.ttft_ms:.1f} vs {theirs.ttft_ms:.1f} ms (x{ratio.ttft_ms:.2f})"
            f"   TPOT p50 {ours.tpot_ms:.1f} vs {theirs.tpot_ms:.1f} ms (x{ratio.tpot_ms:.2f})"
        )
    print(
        f"  prompt tokens, mean: Folio {_mean_prompt_tokens(folio)}, "
        f"{peer_name} {_mean_prompt_tokens(peer)}",
        flush=True,
    )
    return comparisons


def run_serve_benchmark(args: argparse.Namespace) -> list[Comparison]:
    """The benchmark; returns the comparison with --compare-url's server (empty without)."""
    from common.config import engine_config_from_args

    from_args(ServeWorkload, args)  # refuses a bad workload before anything starts
    config = engine_config_from_args(args)
    prompts = workload_prompts(config, args)
    print(
        f"workload: prompts of {args.prompt_len} random tokens"
        + (" as text" if args.compare_url else "")
        + f", {args.output_len} output tokens, "
        + (f"temperature {args.temperature}" if args.temperature else "greedy")
        + ", ignore_eos; runs: "
        + ", ".join(f"{label} x {n}" for label, _, n in levels(args))
    )
    print("TTFT, TPOT and ITL in ms as p50/p90/p99", flush=True)
    from bench.startup import cpu_description  # (bench.startup imports this module)

    print(f"CPU: {cpu_description()}", flush=True)
    if args.url:
        sides = event_loop.run(
            sides_in_turns(args.url.rstrip("/"), None, "gateway", config, args, prompts)
        )
    else:
        workers_first, *others = (int(w) for w in args.gateway_workers.split(","))
        with started_stack(config, workers_first) as stack:
            sides = event_loop.run(
                sides_in_turns(stack.url, stack.meters, stack.name, config, args, prompts)
            )
        by_workers = {workers_first: sides.served}
        for workers in others:
            with started_stack(config, workers) as stack:
                by_workers[workers] = event_loop.run(
                    bench_gateway(stack.url, args, prompts, stack.meters, stack.name)
                )
        compare_workers(by_workers)
    served, local = sides.served, sides.local
    comparisons = []
    if sides.peer is not None:
        comparisons = compare_servers(served, sides.peer, peer_name(args))
    if "c=32" in served and "gateway" in served["c=32"].cpu_ms_per_token:
        print(
            f"gateway CPU per output token at c=32: "
            f"{served['c=32'].cpu_ms_per_token['gateway']:.3f} ms (target <= 0.15 ms)"
        )
    if local is None:
        return comparisons
    labels = list(served)
    first = labels[0]
    # The targets: throughput at least 95% of in-process at c=1 and c=32 and 90% at c=128,
    # decode speed 95% at c=1, TTFT at c=1.
    sweep = args.request_rate is None
    targets = {"c=1": 0.95, "c=32": 0.95, "c=128": 0.90} if sweep else {}
    for label in labels:
        target = f" (target >= {targets[label]:.2f})" if label in targets else ""
        print(
            f"throughput gateway/in-process at {label}: "
            f"{served[label].token_throughput / local[label].token_throughput:.2f}{target}"
        )
    if "c=1" in labels:
        # One stream's decode speed, tokens per second after the first: in-process TPOT over
        # served TPOT (p50).
        print(
            f"decode speed (1/TPOT p50) gateway/in-process at c=1: "
            f"{local['c=1'].tpot()[0] / served['c=1'].tpot()[0]:.2f} (target >= 0.95)"
        )
    added = served[first].ttft()[0] - local[first].ttft()[0]
    print(
        f"TTFT added by the service hops at {first}, p50: {added:.1f} ms"
        + (" (target <= 10 ms)" if sweep else "")
    )
    return comparisons
