"""The vLLM-named series of /metrics: the model-server metrics protocol that endpoint pickers
read (the Gateway API Inference Extension's, llm-d's), next to Folio's own names.

For those pickers one pod runs one `folio serve`; the gauges are its engines' GetStats answer as
the gateway pools it (gateway/engines/replicas.py): with several replicas, requests are summed, KV
usage is the pool-weighted mean and the blocks are the pool's; Folio's per-replica series keep the
detail. The names carry vLLM's colons, which Prometheus allows in metric names (and reserves for
recording rules by convention only). Formatting only: it never talks to a service.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.messages import EngineStats


def vllm_families(stats: EngineStats) -> Iterator[Metric]:
    """The engine's load under vLLM's names, from one GetStats answer."""
    yield GaugeMetricFamily(
        "vllm:num_requests_running",
        "Requests in the engines' running batches (vLLM name).",
        value=stats.num_running,
    )
    yield GaugeMetricFamily(
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled (vLLM name).",
        value=stats.num_waiting,
    )
    yield GaugeMetricFamily(
        "vllm:kv_cache_usage_perc",
        "Share of KV cache blocks in use, 0 to 1 (vLLM name; 1 means 100 percent).",
        value=stats.kv_cache_usage,
    )
    config = GaugeMetricFamily(
        "vllm:cache_config_info",
        "The KV cache's configuration in its labels (vLLM name).",
        labels=["block_size", "cache_dtype", "num_gpu_blocks"],
    )
    config.add_metric([str(stats.block_size), stats.kv_cache_dtype, str(stats.num_kv_blocks)], 1.0)
    yield config
    # Speculative decoding (engine/spec_decode), summed over the engines.
    for name, text, value in (
        (
            "num_drafts",
            "Verification steps of a request with drafted tokens",
            stats.spec_num_drafts,
        ),
        ("num_draft_tokens", "Tokens drafted", stats.spec_num_draft_tokens),
        ("num_accepted_tokens", "Drafted tokens accepted", stats.spec_num_accepted_tokens),
    ):
        yield CounterMetricFamily(f"vllm:spec_decode_{name}", f"{text} (vLLM name).", value=value)
    if stats.max_lora:
        # vLLM's shape: the adapters in the labels, comma-separated, and the time of the
        # answer as the value (a reader takes the newest series).
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "The LoRA adapters of the running and of the waiting requests (vLLM name).",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        lora.add_metric(
            [
                ",".join(stats.running_lora_adapters),
                ",".join(stats.waiting_lora_adapters),
                str(stats.max_lora),
            ],
            time.time(),
        )
        yield lora
