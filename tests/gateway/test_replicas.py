"""The gateway over several engine replicas: simulated engines (the real scheduler, KV cache and
engine service, modelled step times, no model) on loopback, the real tokenizer service and the
real gateway. cache_aware sends a conversation's later turns to the replica whose prefix cache
holds its earlier ones (learnt from that replica's KV events) and they hit that cache; a request
whose replica dies before its first token completes on another replica; the dead replica leaves
the rotation (the gateway stays healthy and serves) and comes back once it serves again."""

from __future__ import annotations

import functools
import threading

import httpx
import pytest

import polling
from common.config import EngineConfig, GatewayConfig
from engine.simulated import StepCostModel, simulated_engine
from gateway.engines import replicas as replicas_module
from gateway_helpers import GatewayThread, read_metrics
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.server import EngineService
from services.engine.simulate import simulated_services
from services.tokenizer.server import TokenizerService

FAST = StepCostModel(fixed_seconds=0.002, prefill_token_seconds=0.0, decode_sequence_seconds=0.0)
# Prefills slow enough to kill a replica before its first token, decodes quick.
SLOW_PREFILL = StepCostModel(
    fixed_seconds=0.002, prefill_token_seconds=0.1, decode_sequence_seconds=0.0
)
SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about opening "
    "hours, loans, renewals and the reading room, briefly and politely, in plain words."
)


@pytest.fixture(scope="module")
def tokenizer_address(default_model_dir):
    server = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    yield f"127.0.0.1:{server.port}"
    server.close()


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=256)


def chat(url: str, messages: list[dict], max_tokens: int = 4) -> dict:
    response = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": max_tokens, "ignore_eos": True},
        timeout=TIMEOUT,
    )
    assert response.status_code == 200, response.text
    return response.json()


def replica_series(url: str, name: str) -> dict[str, float]:
    """A per-replica series of /metrics: replica address -> value."""
    prefix = name + '{replica="'
    return {
        key[len(prefix) : -2]: value
        for key, value in read_metrics(url).items()
        if key.startswith(prefix)
    }


# Polls with this file's deadline.
wait_until = functools.partial(polling.wait_until, seconds=TIMEOUT)


def test_cache_aware_keeps_a_conversation_on_the_replica_holding_its_prefix(
    default_model_dir, tokenizer_address
):
    config = engine_config(default_model_dir)
    engines = [ServerThread(s) for s in simulated_services(config, FAST, "127.0.0.1", 0, 2)]
    gateway = GatewayThread(
        [f"127.0.0.1:{e.port}" for e in engines],
        tokenizer_address,
        GatewayConfig(routing_policy="cache_aware"),
    )
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
        for turn in range(3):
            answer = chat(gateway.url, messages)
            routed = replica_series(gateway.url, "folio_replica_requests_routed_total")
            [(first, count)] = [(r, n) for r, n in routed.items() if n]
            assert count == turn + 1, routed  # every turn on the same replica
            # The gateway learns what that replica cached from its KV events, then sends the
            # next turn, which quotes this one.
            wait_until(
                lambda first=first: replica_series(gateway.url, "folio_replica_indexed_blocks").get(
                    first
                ),
                "the KV events of the turn",
            )
            messages += [
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"And what about question {turn}?"},
            ]
            if turn:
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        hits = replica_series(gateway.url, "folio_replica_prefix_cache_hits_total")
        assert hits[first] > 0 and sum(hits.values()) == hits[first]
    finally:
        gateway.close()
        for engine in engines:
            engine.close()


# Prefill tokens that cost something, so that where a prompt's tokens are counted matters.
COSTED_PREFILL = StepCostModel(
    fixed_seconds=0.002, prefill_token_seconds=0.0005, decode_sequence_seconds=0.0
)


def test_a_conversation_stays_on_its_replica_between_load_polls(
    default_model_dir, tokenizer_address, monkeypatch
):
    # The load polls come seldom (as on a loaded machine, against turns that take
    # milliseconds): the earlier turns, placed since the last poll and long computed, must not
    # count as prefill still queued there, nor their cached prefixes as tokens to compute.
    monkeypatch.setattr(replicas_module, "MONITOR_SECONDS", 3600.0)
    config = engine_config(default_model_dir)
    engines = [
        ServerThread(s) for s in simulated_services(config, COSTED_PREFILL, "127.0.0.1", 0, 2)
    ]
    gateway = GatewayThread(
        [f"127.0.0.1:{e.port}" for e in engines],
        tokenizer_address,
        GatewayConfig(routing_policy="cache_aware"),
    )
    try:
        pool = gateway.server.gateway.engine
        wait_until(lambda: all(r.stats for r in pool.replicas), "the first load poll")
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
        indexed = 0
        for turn in range(4):
            answer = chat(gateway.url, messages, max_tokens=8)
            # Read in the gateway, not on /metrics: that asks GetStats, a poll.
            placed = [r.placed_since_stats for r in pool.replicas]
            assert sorted(placed) == [0, turn + 1], placed  # every turn on the same replica
            [holder] = [r for r in pool.replicas if r.placed_since_stats]
            assert holder.tokens_since_stats == 0  # every prefill is done
            wait_until(
                lambda holder=holder, indexed=indexed: (
                    pool.index.num_blocks(holder.index) > indexed
                ),
                "the KV events of the turn",
            )
            indexed = pool.index.num_blocks(holder.index)
            messages += [
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"And what about question {turn}?"},
            ]
            if turn:
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    finally:
        gateway.close()
        for engine in engines:
            engine.close()


def test_a_request_aborted_before_its_first_token_leaves_no_prefill_counted(
    default_model_dir, tokenizer_address
):
    # One replica: no poll ever clears what its requests are counted for.
    config = engine_config(default_model_dir)
    [service] = simulated_services(config, SLOW_PREFILL, "127.0.0.1", 0, 1)
    engine = ServerThread(service)
    gateway = GatewayThread([f"127.0.0.1:{engine.port}"], tokenizer_address)
    try:
        [replica] = gateway.server.gateway.engine.replicas
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
        # The client gives up during the prefill (seconds long): the gateway aborts it.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gateway.url + "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 4, "stream": True},
                timeout=httpx.Timeout(TIMEOUT, read=0.5),
            )
        wait_until(lambda: replica.in_flight == 0, "the request to be released")
        assert replica.prefilling == {}
    finally:
        gateway.close()
        engine.close()


def test_a_replica_lost_before_the_first_token_is_retried_elsewhere_and_leaves_the_rotation(
    default_model_dir, tokenizer_address
):
    config = engine_config(default_model_dir)
    engines = [ServerThread(s) for s in simulated_services(config, SLOW_PREFILL, "127.0.0.1", 0, 2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    # round_robin: the first request goes to the first replica.
    gateway = GatewayThread(
        addresses, tokenizer_address, GatewayConfig(routing_policy="round_robin")
    )
    revived: ServerThread | None = None
    try:
        answers: list[dict] = []
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
        client = threading.Thread(target=lambda: answers.append(chat(gateway.url, messages)))
        client.start()
        # Read in the gateway itself: /metrics asks the engines' GetStats, which an engine
        # answers between steps, so only after this prefill.
        first = gateway.server.gateway.engine.replicas[0]
        wait_until(lambda: first.in_flight, "the request to go to the first replica")
        engines[0].close()  # its prefill takes seconds: no token has left it
        client.join(TIMEOUT)
        [answer] = answers
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 4
        routed = replica_series(gateway.url, "folio_replica_requests_routed_total")
        assert routed == {addresses[0]: 1, addresses[1]: 1}

        # Out of rotation: the gateway is healthy and every request goes to the live replica.
        wait_until(
            lambda: replica_series(gateway.url, "folio_replica_healthy")[addresses[0]] == 0,
            "the dead replica to leave the rotation",
        )
        assert httpx.get(gateway.url + "/health", timeout=TIMEOUT).status_code == 200
        for _ in range(2):
            chat(gateway.url, [{"role": "user", "content": "Are you there?"}], max_tokens=1)
        routed = replica_series(gateway.url, "folio_replica_requests_routed_total")
        assert routed == {addresses[0]: 1, addresses[1]: 3}

        # Back once it serves again (a new engine on the same port).
        port = int(addresses[0].rsplit(":", 1)[1])
        revived = ServerThread(
            EngineService(
                config, "127.0.0.1", port, build_engine=lambda: simulated_engine(config, FAST)
            )
        )
        wait_until(
            lambda: replica_series(gateway.url, "folio_replica_healthy")[addresses[0]] == 1,
            "the replica to come back",
        )
        for _ in range(2):
            chat(gateway.url, [{"role": "user", "content": "Still there?"}], max_tokens=1)
        routed = replica_series(gateway.url, "folio_replica_requests_routed_total")
        assert routed[addresses[0]] >= 2
    finally:
        gateway.close()
        for engine in [*engines[1:], *([revived] if revived else [])]:
            engine.close()


def test_a_replica_that_stops_answering_has_no_load_series_left(
    default_model_dir, tokenizer_address
):
    # One replica: no monitor polls it, only /metrics asks its GetStats.
    config = engine_config(default_model_dir)
    [engine] = [ServerThread(s) for s in simulated_services(config, FAST, "127.0.0.1", 0, 1)]
    gateway = GatewayThread([f"127.0.0.1:{engine.port}"], tokenizer_address)
    try:
        assert replica_series(gateway.url, "folio_replica_num_requests_running")
        engine.close()
        # Not the last answer it gave: each gateway worker's last one may differ.
        assert replica_series(gateway.url, "folio_replica_num_requests_running") == {}
    finally:
        gateway.close()
