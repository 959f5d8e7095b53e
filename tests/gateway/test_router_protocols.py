"""What routers and endpoint pickers in front of Folio read from its gateway, over two simulated
engine replicas of different KV pools (the real scheduler, KV cache and engine service, modelled
step times, no model), the real tokenizer service and the real gateway:

- the vLLM-named series of /metrics that the Gateway API Inference Extension and llm-d read,
  parsed with prometheus-client's parser: the pool's sums (KV usage its block-weighted mean)
  of the same GetStats answers the per-replica series show;
- SMG's discovery and load endpoints (/server_info, /model_info, /v1/loads) in the shapes
  SMG 1.13.0 deserializes, with the same engine numbers.
"""

from __future__ import annotations

import functools
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import polling
from common.config import EngineConfig, GatewayConfig
from engine.simulated import StepCostModel
from gateway_helpers import GatewayThread
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.simulate import simulated_services
from services.tokenizer.server import TokenizerService

BLOCK_SIZE = 16
POOL_BLOCKS = (256, 64)  # the two replicas' KV pools: unequal, so a plain mean would differ
MAX_NUM_SEQS = 8
# Decode steps slow enough that requests are seen running, quick enough to end soon.
COST = StepCostModel(fixed_seconds=0.02, prefill_token_seconds=0.0, decode_sequence_seconds=0.0)
PROMPT = "Tell me about the opening hours of the reading room, the loans and the renewals. " * 4


@pytest.fixture(scope="module")
def two_replicas(default_model_dir):
    tokenizer = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    engines = [
        ServerThread(service)
        for blocks in POOL_BLOCKS
        for service in simulated_services(
            EngineConfig(
                model=str(default_model_dir),
                block_size=BLOCK_SIZE,
                num_kv_blocks=blocks,
                max_num_seqs=MAX_NUM_SEQS,
            ),
            COST,
            "127.0.0.1",
            0,
            1,
        )
    ]
    gateway = GatewayThread(
        [f"127.0.0.1:{e.port}" for e in engines],
        f"127.0.0.1:{tokenizer.port}",
        GatewayConfig(routing_policy="round_robin"),
    )
    yield gateway
    gateway.close()
    for engine in engines:
        engine.close()
    tokenizer.close()


def scrape(url: str) -> dict[str, list]:
    """/metrics parsed by prometheus-client: family name -> its samples."""
    response = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    return {family.name: family.samples for family in text_string_to_metric_families(response.text)}


def value(families: dict[str, list], name: str) -> float:
    [sample] = families[name]
    return sample.value


def per_replica(families: dict[str, list], name: str) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in families[name]}


def generate_in_background(url: str, count: int) -> list[threading.Thread]:
    def one() -> None:
        response = httpx.post(
            url + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True},
            timeout=TIMEOUT,
        )
        assert response.status_code == 200, response.text

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


# Polls with this file's deadline.
wait_until = functools.partial(polling.wait_until, seconds=TIMEOUT)


def busy_scrape(url: str) -> dict[str, list] | None:
    """A scrape in which both replicas run requests, else None."""
    families = scrape(url)
    running = per_replica(families, "folio_replica_num_requests_running")
    return families if len(running) == 2 and all(running.values()) else None


def test_vllm_named_series_pool_the_replicas_that_folio_series_detail(two_replicas):
    url = two_replicas.url
    idle = scrape(url)
    [config] = idle["vllm:cache_config_info"]
    assert config.labels == {
        "block_size": str(BLOCK_SIZE),
        "cache_dtype": "bfloat16",  # the engine the simulated one stands for
        "num_gpu_blocks": str(sum(POOL_BLOCKS)),
    }
    assert config.value == 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert idle[name][0].labels == {}
    threads = generate_in_background(url, 6)  # round robin: three on each replica
    try:
        families = wait_until(lambda: busy_scrape(url), "both replicas to run requests")
        running = per_replica(families, "folio_replica_num_requests_running")
        waiting = per_replica(families, "folio_replica_num_requests_waiting")
        usage = per_replica(families, "folio_replica_kv_cache_usage_ratio")
        assert value(families, "vllm:num_requests_running") == sum(running.values()) > 0
        assert value(families, "vllm:num_requests_waiting") == sum(waiting.values())
        assert value(families, "vllm:num_requests_running") == value(
            families, "folio_num_requests_running"
        )
        # The replicas' order in the gateway is the order of POOL_BLOCKS.
        replicas = [r.name for r in two_replicas.server.gateway.engine.replicas]
        blocks = dict(zip(replicas, POOL_BLOCKS, strict=True))
        weighted = sum(usage[r] * blocks[r] for r in replicas) / sum(POOL_BLOCKS)
        kv_usage = value(families, "vllm:kv_cache_usage_perc")
        assert kv_usage == pytest.approx(weighted)
        assert 0 < kv_usage < 1
        # Unequal pools with the same requests: the plain mean is another number.
        assert kv_usage != pytest.approx(sum(usage.values()) / 2)
        assert kv_usage == pytest.approx(value(families, "folio_kv_cache_usage_ratio"))
    finally:
        for thread in threads:
            thread.join(TIMEOUT)


def test_smg_discovery_and_load_endpoints_answer_in_sglang_shapes(two_replicas):
    url = two_replicas.url
    model = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
    server_info = httpx.get(url + "/server_info", timeout=TIMEOUT)
    assert server_info.status_code == 200
    assert server_info.json() == {
        "model_path": model["root"],
        "served_model_name": model["id"],
        "context_length": model["max_model_len"],
        "max_total_tokens": BLOCK_SIZE * sum(POOL_BLOCKS),
        "max_running_requests": MAX_NUM_SEQS * 2,
        "dp_size": 1,
        "is_embedding": False,
    }
    model_info = httpx.get(url + "/model_info", timeout=TIMEOUT).json()
    assert model_info == {
        "model_path": model["root"],
        "tokenizer_path": model["root"],
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }

    threads = generate_in_background(url, 4)
    try:
        wait_until(lambda: busy_scrape(url), "both replicas to run requests")
        loads = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=TIMEOUT)
        assert loads.status_code == 200
        body = loads.json()
        assert set(body) == {"timestamp", "dp_rank_count", "loads"}
        assert body["dp_rank_count"] == 1
        [load] = body["loads"]
        capacity = BLOCK_SIZE * sum(POOL_BLOCKS)
        assert load["dp_rank"] == 0
        assert load["max_total_num_tokens"] == capacity
        assert load["max_running_requests"] == MAX_NUM_SEQS * 2
        assert 0 < load["num_running_reqs"] <= 4
        assert load["num_total_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"]
        assert 0 < load["token_usage"] < 1
        assert load["num_used_tokens"] == round(load["token_usage"] * capacity)
        assert 0 <= load["cache_hit_rate"] <= 1
    finally:
        for thread in threads:
            thread.join(TIMEOUT)
    # Idle again: the engines' numbers, not the gateway's own count, fall back to zero.
    idle = wait_until(lambda: idle_load(url), "the engines to go idle")
    assert idle["token_usage"] == 0 and idle["num_used_tokens"] == 0


def idle_load(url: str) -> dict | None:
    [load] = httpx.get(url + "/v1/loads", timeout=TIMEOUT).json()["loads"]
    return load if load["num_total_reqs"] == 0 else None
