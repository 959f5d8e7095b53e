"""`folio bench goodput`: two tenants, one sending `--ratio` times the other's rate, against
the scheduling policies at several multiples of the server's capacity, with deadlines.

Per policy and load it prints, per tenant, TTFT p50/p99 (of the requests that got a first token),
the share of the tokens computed, and goodput: requests per second that met both deadlines
(first token by --slo-ttft-ms, end by --slo-total-ms; a refused request met none). Runs:

- fcfs as Folio served before deadlines: the engine is not told the deadlines (they are only
  scored), so it computes requests whose clients gave up;
- priority: the light tenant at priority 0, the heavy one at 1, deadlines sent;
- fair: both tenants at weight 1, deadlines sent;
- and the light tenant alone at its rate, the reference for its TTFT p99.

On one real engine (the model of --model) and on --replicas simulated engines (the step cost
model of --step-cost, requests to the replica with the fewest outstanding). The simulated
engines' capacity is computed from their step cost model; the real engine's is served: the
requests per second it finishes with its queue never empty, through this same driver, on the
machine as loaded as it is then (its steps measured alone at a full batch promise more than it
keeps beside the driver and other work), and its mean step then sets the default deadlines.
Engines run in this process, each in its own loop thread (the engine service's AsyncEngine), so
the scheduler is what is measured, not HTTP. Targets, same run: at 2x capacity the light
tenant's TTFT p99 under fair within 2x of its p99 alone, and goodput at least 2x fcfs's.

A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.flags import flag

HEAVY, LIGHT = "heavy", "light"


@dataclass
class GoodputWorkload:
    """Goodput workload."""

    seconds: float = flag(20.0, "seconds of arrivals in each run")
    prompt_tokens: int = flag(96, "tokens of each prompt")
    output_tokens: int = flag(24, "tokens each request generates")
    ratio: float = flag(10.0, "the heavy tenant's request rate over the light tenant's")
    loads: str = flag("0.8,1.2,2", "offered loads, as multiples of the server's capacity")
    policies: str = flag("fcfs,priority,fair", "comma-separated scheduling policies")
    slo_ttft_ms: float | None = flag(
        None, "deadline of the first token (default: 20 steps of a full batch)"
    )
    slo_total_ms: float | None = flag(
        None, "deadline of the end (default: the TTFT deadline plus 3x the output's decode time)"
    )
    replicas: int = flag(32, "simulated engines of the second part (0: skip it)")
    skip_real: bool = flag(False, "skip the part on one real engine")
    workload_seed: int = flag(0, "seed of the arrivals and prompts")


@dataclass
class Outcome:
    tenant: str
    sent: float
    first_token: float | None = None
    ended: float | None = None
    refused: bool = False
    deadline_ended: bool = False
    computed_tokens: int = 0


@dataclass
class Run:
    label: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    overrun: float | None = None  # share of the modelled step time the steps overran


@dataclass
class Setup:
    """Engines to run a workload on."""

    name: str
    build: Callable[[str], list]  # policy -> AsyncEngines, started
    step_seconds: Callable[[int, int], float]  # (prefill tokens, decodes) -> seconds
    max_num_seqs: int
    token_budget: int
    num_engines: int
    # Measure the capacity by serving (a real engine: its steps beside this driver are what
    # they are on the machine now), not from the step cost model.
    served_capacity: bool = False


def capacity(setup: Setup, workload: GoodputWorkload) -> float:
    """Requests per second the engines finish at best, from their step costs: full batches
    decoding, each request's prompt prefilled in the budget beside them."""
    seqs = setup.max_num_seqs
    decode_steps = workload.output_tokens
    batch_seconds = decode_steps * setup.step_seconds(0, seqs) + setup.step_seconds(
        seqs * workload.prompt_tokens, 0
    )
    return setup.num_engines * seqs / batch_seconds


async def _drive(
    engines: list, arrivals: list[tuple[float, str]], prompts: dict, workload, policy, slo
) -> Run:
    from common.sampling_params import SamplingParams
    from common.service_level import ServiceLevel

    ttft_ms, total_ms = slo
    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True, temperature=0.0)
    outstanding = [0] * len(engines)
    run = Run(policy)
    start = time.monotonic()

    async def one(number: int, at: float, tenant: str) -> None:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        outcome = Outcome(tenant, time.monotonic())
        run.outcomes.append(outcome)
        replica = min(range(len(engines)), key=outstanding.__getitem__)
        outstanding[replica] += 1
        events: asyncio.Queue = asyncio.Queue()
        informed = policy != "fcfs"  # fcfs: as before deadlines, the engine is not told
        service = ServiceLevel(
            tenant, 1.0, ttft_ms if informed else None, total_ms if informed else None
        )
        priority = (0 if tenant == LIGHT else 1) if policy == "priority" else 0
        engines[replica].add_request(
            f"{tenant}-{number}", prompts[tenant], params, events, priority, service=service
        )
        try:
            await _follow(events, outcome)
        finally:
            outstanding[replica] -= 1

    await asyncio.gather(*(one(i, at, tenant) for i, (at, tenant) in enumerate(arrivals)))
    run.seconds = time.monotonic() - start
    return run


async def _follow(events: asyncio.Queue, outcome: Outcome) -> None:
    """Fill `outcome` from a request's events until it ends (or is refused)."""
    from engine.async_engine import RequestFailed

    while outcome.ended is None:
        for event in await events.get():
            if isinstance(event, RequestFailed):  # refused
                outcome.refused = True
                outcome.ended = time.monotonic()
                break
            now = time.monotonic()
            if event.new_token_ids and outcome.first_token is None:
                outcome.first_token = now
            if event.finished:
                outcome.ended = now
                outcome.deadline_ended = event.finish_reason == "deadline"
                outcome.computed_tokens = event.num_prompt_tokens + event.num_output_tokens


async def _saturate(engines: list, prompt: list[int], workload, seconds: float) -> float:
    """Requests per second `engines` finish with their queues never empty: per engine, twice
    its max_num_seqs requests kept outstanding through this driver, counted after the first
    quarter of `seconds` (the warm-up)."""
    from common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True, temperature=0.0)
    start = time.monotonic()
    counted_from, until = start + seconds / 4, start + seconds
    ended: list[float] = []

    async def client(engine, number: int) -> None:
        while time.monotonic() < until:
            events: asyncio.Queue = asyncio.Queue()
            outcome = Outcome(HEAVY, time.monotonic())
            engine.add_request(f"saturate-{number}-{len(ended)}", prompt, params, events)
            await _follow(events, outcome)
            if outcome.ended is not None and outcome.ended >= counted_from:
                ended.append(outcome.ended)

    per_engine = 2 * engines[0].engine.config.max_num_seqs
    await asyncio.gather(
        *(client(e, i * per_engine + j) for i, e in enumerate(engines) for j in range(per_engine))
    )
    return sum(1 for t in ended if t <= until) / (until - counted_from)


def _arrivals(rates: dict[str, float], seconds: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    arrivals = []
    for tenant, rate in rates.items():
        at = rng.expovariate(rate) if rate > 0 else seconds
        while at < seconds:
            arrivals.append((at, tenant))
            at += rng.expovariate(rate)
    return sorted(arrivals)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class TenantFigures:
    ttft_p50: float
    ttft_p99: float
    share: float
    goodput: float
    refused: int
    requests: int


def figures(run: Run, tenant: str, slo: tuple[float, float], arrivals_seconds: float):
    ttft_s, total_s = slo[0] / 1000, slo[1] / 1000
    mine = [o for o in run.outcomes if o.tenant == tenant]
    ttfts = [o.first_token - o.sent for o in mine if o.first_token is not None]
    total_tokens = sum(o.computed_tokens for o in run.outcomes) or 1
    met = [
        o
        for o in mine
        if o.first_token is not None
        and o.ended is not None
        and not o.deadline_ended
        and o.first_token - o.sent <= ttft_s
        and o.ended - o.sent <= total_s
    ]
    return TenantFigures(
        statistics.median(ttfts) if ttfts else math.nan,
        _percentile(ttfts, 0.99),
        sum(o.computed_tokens for o in mine) / total_tokens,
        len(met) / arrivals_seconds,
        sum(o.refused for o in mine),
        len(mine),
    )


def _run(setup: Setup, policy: str, arrivals, prompts, workload, slo) -> Run:
    engines = setup.build(policy)
    try:
        run = asyncio.run(_drive(engines, arrivals, prompts, workload, policy, slo))
        overrun = [e.engine.timings.overrun for e in engines]
        forward = sum(e.engine.timings.forward for e in engines)
        if all(o is not None for o in overrun) and forward:
            run.overrun = sum(overrun) / forward
    finally:
        for engine in engines:
            engine.shutdown(60)
    return run


def _served(setup: Setup, workload: GoodputWorkload, prompt: list[int]) -> tuple[float, float]:
    """The engines' capacity served (requests/s) and their mean step meanwhile (seconds): a
    saturated run as long as one run's arrivals."""
    engines = setup.build("fcfs")
    try:
        rps = asyncio.run(_saturate(engines, prompt, workload, workload.seconds))
        timings = [e.engine.timings for e in engines]
        step = sum(t.total for t in timings) / max(1, sum(t.steps for t in timings))
    finally:
        for engine in engines:
            engine.shutdown(60)
    return rps, step


def run_part(setup: Setup, workload: GoodputWorkload, tokenizer_vocab: int) -> None:
    rng = random.Random(workload.workload_seed)
    prompts = {
        t: [rng.randrange(100, tokenizer_vocab) for _ in range(workload.prompt_tokens)]
        for t in (HEAVY, LIGHT)
    }
    full_step = setup.step_seconds(0, setup.max_num_seqs)
    rps = capacity(setup, workload)
    how = "from the step costs"
    if setup.served_capacity:
        modelled = rps
        rps, full_step = _served(setup, workload, prompts[HEAVY])
        how = f"served with its queue never empty; the step costs said {modelled:.1f}"
    ttft_ms = workload.slo_ttft_ms or 20 * full_step * 1000
    total_ms = workload.slo_total_ms or ttft_ms + 3 * workload.output_tokens * full_step * 1000
    slo = (ttft_ms, total_ms)
    print(
        f"\n{setup.name}: capacity {rps:.1f} requests/s ({how}; {workload.prompt_tokens} prompt "
        f"+ {workload.output_tokens} output tokens each; a full batch's step "
        f"{full_step * 1e3:.1f} ms); deadlines: first token {ttft_ms:.0f} ms, end "
        f"{total_ms:.0f} ms; {workload.seconds:g} s of arrivals per run",
        flush=True,
    )
    header = (
        f"  {'load':>5s} {'policy':12s} {'tenant':6s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
        f"{'tokens':>7s} {'goodput':>9s} {'refused':>8s}"
    )
    print(header)
    policies = [p for p in workload.policies.split(",") if p]
    for load in (float(x) for x in workload.loads.split(",")):
        total_rate = load * rps
        light_rate = total_rate / (1 + workload.ratio)
        rates = {HEAVY: total_rate - light_rate, LIGHT: light_rate}
        arrivals = _arrivals(rates, workload.seconds, workload.workload_seed)
        alone = _run(
            setup,
            "fcfs",
            [a for a in arrivals if a[1] == LIGHT],
            prompts,
            workload,
            slo,
        )
        alone_p99 = figures(alone, LIGHT, slo, workload.seconds).ttft_p99
        print(f"  {load:5.1f} {'light alone':12s} {LIGHT:6s} TTFT p99 {alone_p99 * 1e3:7.0f}ms")
        goodputs: dict[str, float] = {}
        light_p99: dict[str, float] = {}
        for policy in policies:
            run = _run(setup, policy, arrivals, prompts, workload, slo)
            total = 0.0
            for tenant in (HEAVY, LIGHT):
                f = figures(run, tenant, slo, workload.seconds)
                total += f.goodput
                if tenant == LIGHT:
                    light_p99[policy] = f.ttft_p99
                print(
                    f"  {load:5.1f} {policy:12s} {tenant:6s} {f.ttft_p50 * 1e3:7.0f}ms "
                    f"{f.ttft_p99 * 1e3:7.0f}ms {f.share * 100:6.1f}% {f.goodput:7.2f}/s "
                    f"{f.refused:4d}/{f.requests}"
                )
            goodputs[policy] = total
            note = f"  (steps overran the model by {run.overrun * 100:.1f}%)" if run.overrun else ""
            print(f"  {load:5.1f} {policy:12s} {'both':6s} goodput {total:.2f}/s{note}", flush=True)
        if "fcfs" in goodputs and "fair" in goodputs:
            gain = goodputs["fair"] / max(goodputs["fcfs"], 1e-9)
            print(
                f"  {load:5.1f} fair vs fcfs: goodput {gain:.2f}x; "
                f"light TTFT p99 {light_p99['fair'] / alone_p99:.2f}x its p99 alone "
                f"(fcfs {light_p99['fcfs'] / alone_p99:.2f}x)",
                flush=True,
            )


def _measure_full_batch(engine, workload: GoodputWorkload):
    """This engine's step costs at a full batch of this workload, measured: one step
    prefilling max_num_seqs prompts, the median decode step beside them (a StepCostModel
    whose fixed cost is that decode step)."""
    from common.sampling_params import SamplingParams
    from engine.core.step_cost import StepCostModel

    seqs = engine.config.max_num_seqs
    for _ in range(2):  # the first round warms up
        for i in range(seqs):
            engine.add_request(
                f"w{i}",
                [100 + i] * workload.prompt_tokens,
                SamplingParams(max_tokens=8, ignore_eos=True),
            )
        times = []
        while engine.has_unfinished:
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
    decode = statistics.median(times[1:])
    prefill_tokens = seqs * workload.prompt_tokens
    return StepCostModel(decode, max(0.0, (times[0] - decode) / prefill_tokens), 0.0)


def _engines(build: Callable[[], object], count: int) -> list:
    from engine.async_engine import AsyncEngine

    engines = [AsyncEngine(build) for _ in range(count)]  # type: ignore[arg-type]
    for engine in engines:
        engine.start().result()
    return engines


def run_goodput_benchmark(args: argparse.Namespace) -> None:
    from common.config import engine_config_from_args
    from engine.core.step_cost import StepCostModel
    from engine.simulated import simulated_engine

    workload = GoodputWorkload(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(GoodputWorkload)}
    )
    config = engine_config_from_args(args)
    config.enable_prefix_caching = False  # every prompt costs what it costs
    if not workload.skip_real:
        from engine.engine import LLMEngine

        probe = LLMEngine(dataclasses.replace(config))
        vocab = probe.vocab_size
        measured = _measure_full_batch(probe, workload)
        probe.close()
        setup = Setup(
            f"one real engine ({probe.dtype_name}, max_num_seqs {config.max_num_seqs})",
            lambda policy: _engines(
                lambda: LLMEngine(dataclasses.replace(config, scheduling_policy=policy)), 1
            ),
            measured.step_seconds,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            1,
            served_capacity=True,
        )
        run_part(setup, workload, vocab)
    if workload.replicas:
        cost = StepCostModel.load(Path(args.step_cost))
        probe = simulated_engine(config, cost)
        vocab = probe.vocab_size
        setup = Setup(
            f"{workload.replicas} simulated engines (max_num_seqs {config.max_num_seqs} each)",
            lambda policy: _engines(
                lambda: simulated_engine(
                    dataclasses.replace(config, scheduling_policy=policy), cost
                ),
                workload.replicas,
            ),
            cost.step_seconds,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            workload.replicas,
        )
        run_part(setup, workload, vocab)
