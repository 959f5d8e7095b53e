"""The gateway's metrics in the Prometheus text format (version 0.0.4).

Request-level series (latencies, token counts) are observed here as requests run; engine-level
ones (load, KV cache, prefix cache, per-phase step time) come from Engine.GetStats when
scraped. Names follow Prometheus conventions: base units, `_total` for counters, no colons.
Only counting and formatting here: it never talks to a service.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from common.grpc_stubs.folio.v1 import engine_pb2

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _family(name: str, kind: str, help_: str) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]


class Counter:
    def __init__(self, name: str, help_: str) -> None:
        self.name, self.help, self.value = name, help_, 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def lines(self) -> list[str]:
        return [*_family(self.name, "counter", self.help), f"{self.name} {_number(self.value)}"]


class Histogram:
    def __init__(self, name: str, help_: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help_
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self) -> list[str]:
        out = _family(self.name, "histogram", self.help)
        cumulative = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=False):
            cumulative += count
            out.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        out += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {cumulative}"]
        return out


class Metrics:
    """Everything /metrics shows; generation.py feeds the request-level part."""

    def __init__(self) -> None:
        self.prompt_tokens = Counter("folio_prompt_tokens_total", "Prompt tokens prefilled.")
        self.generation_tokens = Counter("folio_generation_tokens_total", "Tokens generated.")
        self.ttft = Histogram(
            "folio_time_to_first_token_seconds",
            "From the request's arrival at the gateway to its first token.",
            LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "folio_inter_token_latency_seconds",
            "Between consecutive tokens of one request.",
            LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "folio_e2e_request_latency_seconds",
            "From the request's arrival at the gateway to its end.",
            REQUEST_BUCKETS,
        )
        self.queue_time = Histogram(
            "folio_request_queue_time_seconds",
            "Time a request waited in the engine before it first ran.",
            REQUEST_BUCKETS,
        )
        self.finished: dict[str, int] = {}

    def request_finished(self, finish_reason: str) -> None:
        self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1

    def render(self, stats: engine_pb2.GetStatsResponse | None) -> str:
        lines: list[str] = []
        if stats is not None:
            lines += self._engine_lines(stats)
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
        ):
            lines += metric.lines()
        lines += _family("folio_requests_total", "counter", "Requests ended, by finish reason.")
        lines += [
            f'folio_requests_total{{finish_reason="{reason}"}} {count}'
            for reason, count in sorted(self.finished.items())
        ]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _engine_lines(stats: engine_pb2.GetStatsResponse) -> list[str]:
        def one(name: str, kind: str, help_: str, value: float) -> list[str]:
            return [*_family(name, kind, help_), f"{name} {_number(value)}"]

        lines = [
            *one(
                "folio_num_requests_running",
                "gauge",
                "Requests in the engine's running batch.",
                stats.num_running,
            ),
            *one(
                "folio_num_requests_waiting",
                "gauge",
                "Requests waiting to be scheduled.",
                stats.num_waiting,
            ),
            *one(
                "folio_kv_cache_usage_ratio",
                "gauge",
                "Share of KV cache blocks in use (0 to 1).",
                stats.kv_cache_usage,
            ),
            *one(
                "folio_num_kv_blocks", "gauge", "KV cache blocks in the pool.", stats.num_kv_blocks
            ),
            *one(
                "folio_prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            *one(
                "folio_prefix_cache_hits_total",
                "counter",
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits,
            ),
            *one(
                "folio_num_preemptions_total",
                "counter",
                "Requests preempted by the scheduler.",
                stats.num_preemptions,
            ),
            *one("folio_engine_steps_total", "counter", "Engine steps run.", stats.num_steps),
        ]
        lines += _family(
            "folio_engine_step_seconds_total",
            "counter",
            "Seconds spent in each phase of the engine step.",
        )
        lines += [
            f'folio_engine_step_seconds_total{{phase="{phase}"}} {_number(seconds)}'
            for phase, seconds in sorted(stats.step_seconds.items())
        ]
        return lines
