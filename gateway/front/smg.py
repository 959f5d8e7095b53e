"""What SMG (the Shepherd Model Gateway, PyPI `smg`) discovers and polls on a worker, so that a
`folio serve` can stand behind it as an SGLang-style HTTP worker: GET /server_info and
/model_info (read once when the worker registers: SMG takes a worker that answers /server_info,
and no vLLM /version, for SGLang) and GET /v1/loads (polled every --load-monitor-interval; its
`token_usage` drives the cache_aware, power_of_two and least_load policies).

The shapes are those SMG deserializes (lightseekorg/smg: model_gateway/src/workflow/steps/local/
discover_metadata.rs: ServerInfo, ModelInfo; crates/protocols/src/worker.rs: WorkerLoadResponse,
SchedulerLoadSnapshot; model_gateway/src/worker/monitor.rs polls /v1/loads), checked against
what the 1.13.0 wheel asks and shows in its /workers (tests/e2e/test_smg.py): fields SMG reads
and Folio knows are filled, the rest left out (SMG takes them as unknown, or zero for loads).
The whole gateway is one worker and one data-parallel rank: its engine replicas are pooled as
/metrics pools them (summed; KV usage the pool-weighted mean). Answers only: the numbers come
from the gateway's model facts and the engines' GetStats; it never routes anything.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel

from common.errors import UnavailableError
from gateway.pipeline.generation import Gateway


class ServerInfo(BaseModel):
    """SGLang's /server_info, the part SMG keeps (as the worker's labels)."""

    model_path: str
    served_model_name: str
    context_length: int
    # Tokens the KV caches of all replicas hold, and requests they run at once.
    max_total_tokens: int | None = None
    max_running_requests: int
    dp_size: int = 1  # one rank for SMG: the replicas are this gateway's to route among
    is_embedding: bool = False


class ModelInfo(BaseModel):
    """SGLang's /model_info."""

    model_path: str
    tokenizer_path: str
    is_generation: bool = True
    has_image_understanding: bool = False
    has_audio_understanding: bool = False


class LoadSnapshot(BaseModel):
    """One data-parallel rank's load (SMG's SchedulerLoadSnapshot)."""

    dp_rank: int = 0
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    token_usage: float  # share of KV cache blocks in use, 0 to 1
    cache_hit_rate: float  # prompt tokens found in the prefix caches, of those looked up
    max_running_requests: int


class Loads(BaseModel):
    """GET /v1/loads (SMG's WorkerLoadResponse)."""

    timestamp: str
    dp_rank_count: int = 1
    loads: list[LoadSnapshot]


def _max_running_requests(gateway: Gateway, max_num_seqs: int) -> int:
    return max_num_seqs * len(gateway.engine.replicas)


async def server_info(gateway: Gateway) -> ServerInfo:
    info = await gateway.model()
    stats = await gateway.engine_stats()
    return ServerInfo(
        model_path=info.path,
        served_model_name=info.name,
        context_length=info.max_model_len,
        max_total_tokens=stats.num_kv_blocks * stats.block_size if stats else None,
        max_running_requests=_max_running_requests(gateway, info.max_num_seqs),
    )


async def model_info(gateway: Gateway) -> ModelInfo:
    info = await gateway.model()
    # The tokenizer service loads the same model directory.
    return ModelInfo(model_path=info.path, tokenizer_path=info.path)


async def loads(gateway: Gateway) -> Loads:
    info = await gateway.model()
    stats = await gateway.engine_stats()
    if stats is None:
        raise UnavailableError("engine: no replica answers for its load")
    capacity = stats.num_kv_blocks * stats.block_size
    hit_rate = (
        stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    )
    snapshot = LoadSnapshot(
        num_running_reqs=stats.num_running,
        num_waiting_reqs=stats.num_waiting,
        num_total_reqs=stats.num_running + stats.num_waiting,
        num_used_tokens=round(stats.kv_cache_usage * capacity),
        max_total_num_tokens=capacity,
        token_usage=stats.kv_cache_usage,
        cache_hit_rate=hit_rate,
        max_running_requests=_max_running_requests(gateway, info.max_num_seqs),
    )
    return Loads(timestamp=datetime.now(UTC).isoformat(), loads=[snapshot])
