"""The gateway's metrics, through prometheus-client, in the Prometheus text format (0.0.4).

Request-level series (latencies, token counts) are observed as requests run (by the output
processor); engine-level ones (load, KV cache, prefix cache, per-phase step time) come from
Engine.GetStats when scraped, through a custom collector, which also writes the same load
under vLLM's names (gateway/engines/vllm_metrics.py) for the endpoint pickers that read those.
Folio's own names follow Prometheus conventions: base units, `_total` for counters, no colons; no
`_created` series. Each Metrics has a registry of its own, so several gateways in one process
do not share counts. A gateway of several worker processes (gateway/front/workers.py) counts in
prometheus-client's multiprocess mode: each worker writes its request-level series to files in
PROMETHEUS_MULTIPROC_DIR and a scrape, whichever worker answers it, sums every worker's; the
engine-level series stay live, from GetStats. The per-replica series a worker keeps itself (its
requests routed, its view of each replica's health and prefix index) are counted the same way, so
that every worker answers the same: the routed counts summed, a replica healthy only while no live
worker has it out of rotation, the most blocks any live worker's index holds. Only counting and
formatting here: it never talks to a service.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.engines.vllm_metrics import vllm_families
from gateway.messages import EngineStats

# A `_created` series per counter and histogram only doubles what is scraped.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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


class EngineStatsCollector(Collector):
    """The engine's load and counters from the latest GetStats answer (none while the engine
    is down: the gateway's own series still count)."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        yield GaugeMetricFamily(
            "folio_num_requests_running",
            "Requests in the engine's running batch.",
            value=stats.num_running,
        )
        yield GaugeMetricFamily(
            "folio_num_requests_waiting",
            "Requests waiting to be scheduled.",
            value=stats.num_waiting,
        )
        yield GaugeMetricFamily(
            "folio_kv_cache_usage_ratio",
            "Share of KV cache blocks in use (0 to 1).",
            value=stats.kv_cache_usage,
        )
        yield GaugeMetricFamily(
            "folio_num_kv_blocks", "KV cache blocks in the pool.", value=stats.num_kv_blocks
        )
        yield CounterMetricFamily(
            "folio_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "folio_prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            value=stats.prefix_cache_hits,
        )
        yield _labelled(
            CounterMetricFamily(
                "folio_kv_tier_hits",
                "Prompt tokens served from each KV cache tier below the pool (host, disk).",
                labels=["tier"],
            ),
            stats.kv_tier_hits,
        )
        yield _labelled(
            GaugeMetricFamily(
                "folio_kv_tier_usage_ratio",
                "Share of each KV cache tier's capacity in use (0 to 1).",
                labels=["tier"],
            ),
            stats.kv_tier_usage,
        )
        yield GaugeMetricFamily(
            "folio_kv_pinned_blocks",
            "Prompt blocks pinned now (the chat cache extension, cache_control), in any tier.",
            value=stats.kv_pinned_blocks,
        )
        if stats.max_lora:
            yield _labelled(
                CounterMetricFamily(
                    "folio_lora_requests",
                    "Requests that named each LoRA adapter.",
                    labels=["lora_name"],
                ),
                stats.lora_requests,
            )
        yield CounterMetricFamily(
            "folio_num_preemptions",
            "Requests preempted by the scheduler.",
            value=stats.num_preemptions,
        )
        yield CounterMetricFamily("folio_engine_steps", "Engine steps run.", value=stats.num_steps)
        yield _labelled(
            CounterMetricFamily(
                "folio_engine_step_seconds",
                "Seconds spent in each phase of the engine step.",
                labels=["phase"],
            ),
            stats.step_seconds,
        )
        yield from vllm_families(stats)


_Family = TypeVar("_Family", CounterMetricFamily, GaugeMetricFamily)


def _labelled(family: _Family, values: Mapping[str, float]) -> _Family:
    """`family` with one series per key of `values` (its one label), in key order."""
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


class Metrics:
    """Everything /metrics shows; the output processor feeds the request-level part."""

    def __init__(self, multiprocess: bool = False) -> None:
        """`multiprocess`: this process is one of a gateway's workers (PROMETHEUS_MULTIPROC_DIR
        was set before prometheus_client was first imported)."""
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = EngineStatsCollector()
        self.registry.register(self._engine)
        self.prompt_tokens = Counter(
            "folio_prompt_tokens", "Prompt tokens prefilled.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "folio_generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.ttft = Histogram(
            "folio_time_to_first_token_seconds",
            "From the request's arrival at the gateway to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "folio_inter_token_latency_seconds",
            "Between consecutive tokens of one request.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "folio_e2e_request_latency_seconds",
            "From the request's arrival at the gateway to its end.",
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "folio_request_queue_time_seconds",
            "Time a request waited in the engine before it first ran.",
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "folio_requests",
            "Requests ended, by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        replica = ["replica"]  # the engine's address
        self.replica_routed = Counter(
            "folio_replica_requests_routed",
            "Engine requests this gateway sent to the replica (retries included).",
            replica,
            registry=self.registry,
        )
        self.replica_healthy = Gauge(
            "folio_replica_healthy",
            "1 while the replica is in rotation.",
            replica,
            multiprocess_mode="livemin",
            registry=self.registry,
        )
        self.replica_indexed_blocks = Gauge(
            "folio_replica_indexed_blocks",
            "KV cache blocks the gateway's prefix index holds for the replica (from its KV "
            "events; cache_aware routing only).",
            replica,
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        if multiprocess:
            # The instruments above write to this worker's files: what is scraped reads every
            # worker's files, and the live collectors (register them here again).
            self.registry = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(self.registry)  # type: ignore[no-untyped-call]
            self.registry.register(self._engine)

    def request_finished(self, finish_reason: str) -> None:
        self.requests.labels(finish_reason).inc()

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample's value (0 if it has none yet), e.g. "folio_generation_tokens_total"."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self, stats: EngineStats | None) -> bytes:
        """The text exposition, with the engine's series from `stats` (None: the engine is
        down)."""
        self._engine.stats = stats
        try:
            return prometheus_client.generate_latest(self.registry)
        finally:
            self._engine.stats = None
