"""The per-replica series of /metrics (label `replica`, the engine's address): requests routed,
health, and each engine's load, KV cache usage and prefix cache counters from its latest GetStats
answer (none for a replica that has not answered), and the blocks the prefix index holds.
Formatting only: it reads the replicas' bookkeeping (gateway/replicas.py) and never talks to a
service.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.replicas import Replica
from gateway.routing import PrefixIndex


class ReplicaCollector(Collector):
    def __init__(self, replicas: Sequence[Replica], index: PrefixIndex) -> None:
        self._replicas = replicas
        self._index = index

    def collect(self) -> Iterator[Metric]:
        labels = ["replica"]
        routed = CounterMetricFamily(
            "folio_replica_requests_routed",
            "Engine requests this gateway sent to the replica (retries included).",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "folio_replica_healthy", "1 while the replica is in rotation.", labels=labels
        )
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
        indexed = GaugeMetricFamily(
            "folio_replica_indexed_blocks",
            "KV cache blocks the gateway's prefix index holds for the replica (from its KV "
            "events; cache_aware routing only).",
            labels=labels,
        )
        for replica in self._replicas:
            name = [replica.name]
            routed.add_metric(name, replica.routed)
            healthy.add_metric(name, 1.0 if replica.healthy else 0.0)
            indexed.add_metric(name, self._index.num_blocks(replica.index))
            stats = replica.stats
            if stats is not None:
                running.add_metric(name, stats.num_running)
                waiting.add_metric(name, stats.num_waiting)
                usage.add_metric(name, stats.kv_cache_usage)
                queries.add_metric(name, stats.prefix_cache_queries)
                hits.add_metric(name, stats.prefix_cache_hits)
        yield from (routed, healthy, indexed, running, waiting, usage, queries, hits)
