"""The dashboard's live feed: one server-sent event per interval with the server's own numbers
(the engine's load from GetStats, through Gateway.engine_stats as /metrics reads it, and the
gateway's token counters), turned into rates over the last interval.

Each reader of the feed gets samples of its own (a GetStats call per interval and reader: a
cheap unary call, and dashboards are few). The feed ends when the gateway drains or its reader
leaves. Sampling and framing only: it never decides who may read it (gateway/limits/auth.py does)
and never changes what it reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from gateway.front.sse import event
from gateway.limits.deadlines import set_deadline
from gateway.messages import EngineStats
from gateway.pipeline.generation import Gateway

GENERATION_TOKENS = "folio_generation_tokens_total"
PROMPT_TOKENS = "folio_prompt_tokens_total"
# An engine busy with a long step answers GetStats late; only one that does not answer within
# this long is shown as down.
STATS_TIMEOUT_SECONDS = 5.0


class DashboardSample(BaseModel):
    """One event of the feed. The engine's fields are null while the engine is down."""

    time: float  # Unix seconds, when the sample was taken
    interval: float  # seconds since the previous sample: what the rates are over
    engine_up: bool
    running: int | None  # requests in the engine's running batch
    waiting: int | None  # requests waiting to be scheduled
    kv_cache_usage: float | None  # share of KV cache blocks in use, 0 to 1
    num_kv_blocks: int | None
    # Share of the prompt tokens looked up in the prefix cache over the interval that were
    # found there; null when none was looked up.
    prefix_cache_hit_rate: float | None
    # Speculative decoding: share of the tokens drafted over the interval that verification
    # accepted; null when none was drafted (or the engine does not speculate).
    draft_acceptance_rate: float | None
    generation_tokens_per_second: float
    prompt_tokens_per_second: float
    steps_per_second: float | None
    # Mean milliseconds an engine step spent in each phase over the interval ("schedule",
    # "prepare_inputs", "forward", "sample", "update"); empty when no step ran.
    step_phase_ms: dict[str, float]
    # KV cache tiers ("host", "disk"; docs/kv_tiers.md): prompt tokens each served over the
    # interval, and the share of each one's capacity in use now; empty without tiers.
    kv_tier_hits: dict[str, int]
    kv_tier_usage: dict[str, float]
    # LoRA adapters (docs/lora.md): requests that named each adapter over the interval (those
    # with none are left out), and the adapters in the engine's slots now; empty without them.
    lora_requests: dict[str, int]
    resident_lora_adapters: list[str]


@dataclass
class Reading:
    """The cumulative counters at one moment, to subtract from the next."""

    monotonic: float
    generation_tokens: float
    prompt_tokens: float
    stats: EngineStats | None


def _rate(now: float, before: float, seconds: float) -> float:
    # A counter that went back (a restarted engine) has no rate over this interval.
    return max(now - before, 0.0) / seconds


def _growth(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """Each counter's growth since `before` (one that went back, a restarted engine's, grew by
    nothing)."""
    return {key: max(value - before.get(key, 0), 0) for key, value in sorted(now.items())}


def sample(previous: Reading, current: Reading, wall_time: float) -> DashboardSample:
    """What changed from `previous` to `current`, as the feed shows it."""
    seconds = max(current.monotonic - previous.monotonic, 1e-9)
    stats, before = current.stats, previous.stats
    hit_rate: float | None = None
    acceptance: float | None = None
    steps_per_second: float | None = None
    phase_ms: dict[str, float] = {}
    tier_hits: dict[str, int] = {}
    lora_requests: dict[str, int] = {}
    if stats is not None and before is not None:
        # Every tier in use is shown, at 0 over an interval it served nothing; of the adapters
        # (dozens, many idle) only those requested.
        tier_hits = _growth(stats.kv_tier_hits, before.kv_tier_hits)
        lora_requests = {
            name: count
            for name, count in _growth(stats.lora_requests, before.lora_requests).items()
            if count > 0
        }
        queries = stats.prefix_cache_queries - before.prefix_cache_queries
        if queries > 0:
            hit_rate = max(stats.prefix_cache_hits - before.prefix_cache_hits, 0) / queries
        drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
        if drafted > 0:
            accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            acceptance = max(accepted, 0) / drafted
        steps = stats.num_steps - before.num_steps
        steps_per_second = _rate(stats.num_steps, before.num_steps, seconds)
        if steps > 0:
            phase_ms = {
                phase: 1000 * max(spent - before.step_seconds.get(phase, 0.0), 0.0) / steps
                for phase, spent in sorted(stats.step_seconds.items())
            }
    return DashboardSample(
        time=wall_time,
        interval=seconds,
        engine_up=stats is not None,
        running=stats.num_running if stats is not None else None,
        waiting=stats.num_waiting if stats is not None else None,
        kv_cache_usage=stats.kv_cache_usage if stats is not None else None,
        num_kv_blocks=stats.num_kv_blocks if stats is not None else None,
        prefix_cache_hit_rate=hit_rate,
        draft_acceptance_rate=acceptance,
        generation_tokens_per_second=_rate(
            current.generation_tokens, previous.generation_tokens, seconds
        ),
        prompt_tokens_per_second=_rate(current.prompt_tokens, previous.prompt_tokens, seconds),
        steps_per_second=steps_per_second,
        step_phase_ms=phase_ms,
        kv_tier_hits=tier_hits,
        kv_tier_usage=dict(sorted(stats.kv_tier_usage.items())) if stats is not None else {},
        lora_requests=lora_requests,
        resident_lora_adapters=sorted(stats.resident_lora_adapters) if stats is not None else [],
    )


async def _read(gateway: Gateway) -> Reading:
    # The feed outlives any request deadline: each reading gets its own.
    set_deadline(time.monotonic() + STATS_TIMEOUT_SECONDS)
    stats = await gateway.engine_stats()
    return Reading(
        monotonic=time.monotonic(),
        generation_tokens=gateway.metrics.value(GENERATION_TOKENS),
        prompt_tokens=gateway.metrics.value(PROMPT_TOKENS),
        stats=stats,
    )


async def feed(gateway: Gateway, interval: float) -> AsyncGenerator[bytes, None]:
    """Server-sent events, one sample every `interval` seconds, until the gateway drains."""
    previous = await _read(gateway)
    while not gateway.draining:
        # A full interval after the last reading, even when that one came late (a loaded
        # machine): rates over a sliver of time would only show noise.
        await asyncio.sleep(max(previous.monotonic + interval - time.monotonic(), 0.0))
        current = await _read(gateway)
        yield event(sample(previous, current, time.time()))
        previous = current
