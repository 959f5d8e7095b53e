"""The per-replica series of /metrics (label `replica`, the engine's address) that come from the
engines: each one's load, KV cache usage and prefix cache counters from its latest GetStats
answer (none for a replica that has not answered). Those the gateway counts itself (requests
routed, health, the blocks its prefix index holds) are gateway/metrics.py's instruments, which
the workers of a gateway share. Formatting only: it reads the replicas' bookkeeping
(gateway/engines/replicas.py) and never talks to a service.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.engines.replicas import Replica


class ReplicaCollector(Collector):
    def __init__(self, replicas: Sequence[Replica]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        labels = ["replica"]
        running = GaugeMetricFamily(
            "folio_replica_num_requests_running",
            "Requests in the replica's running batch.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "folio_replica_num_requests_waiting",
            "Requests waiting in the replica's queue.",
            labels=labels,
        )
        usage = GaugeMetricFamily(
            "folio_replica_kv_cache_usage_ratio",
            "Share of the replica's KV cache blocks in use (0 to 1).",
            labels=labels,
        )
        queries = CounterMetricFamily(
            "folio_replica_prefix_cache_queries",
            "Prompt tokens the replica looked up in its prefix cache.",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "folio_replica_prefix_cache_hits",
            "Prompt tokens the replica found in its prefix cache.",
            labels=labels,
        )
        for replica in self._replicas:
            name = [replica.name]
            stats = replica.stats
            if stats is not None:
                running.add_metric(name, stats.num_running)
                waiting.add_metric(name, stats.num_waiting)
                usage.add_metric(name, stats.kv_cache_usage)
                queries.add_metric(name, stats.prefix_cache_queries)
                hits.add_metric(name, stats.prefix_cache_hits)
        yield from (running, waiting, usage, queries, hits)
