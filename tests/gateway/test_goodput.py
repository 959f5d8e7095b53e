"""Goodput under overload through the real gateway: two API keys, one flooding a simulated
engine (the real scheduler, KV cache and engine service, modelled step times) under the fair
policy, while the other still gets its answers ahead of the flood's queue; deadlines from
headers and from the key file: refused at once when unmeetable (429 with Retry-After) or
malformed (400 naming the header), and a request past its total deadline ends with a 504. The
gRPC text API's ServiceLevel field alike: a tenant it names (the gateway trusts it), the batch
lane, deadlines refused (RESOURCE_EXHAUSTED with retry-after, INVALID_ARGUMENT naming the field)
and ended (DEADLINE_EXCEEDED)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import httpx
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from common.auth import KeySettings, key_of, key_settings, load_api_keys
from common.config import EngineConfig, GatewayConfig
from common.service_level import ServiceLevel
from engine.engine import LLMEngine
from engine.simulated import SimulatedExecutor, StepCostModel
from gateway.limits.service_level import ServiceLevels
from gateway.messages import AskedLevel
from gateway_helpers import GatewayThread, check_error, read_metrics
from grpc_helpers import TIMEOUT, ServerThread
from polling import wait_until
from services.engine.simulate import simulated_services
from services.tokenizer.server import TokenizerService

# 20 ms a step whatever it holds: a flood of 24 requests of 8 tokens on 2 slots is ~2 s of work.
COST = StepCostModel(fixed_seconds=0.02, prefill_token_seconds=0.0, decode_sequence_seconds=0.0)
# While the flood is sent its steps take 10x longer, so that it is queued whole however slowly a
# loaded machine sends it (at 20 ms a step, 24 requests sent over more than half a second never
# all wait at once: the engine drains them as they come).
ARRIVING = StepCostModel(fixed_seconds=0.2, prefill_token_seconds=0.0, decode_sequence_seconds=0.0)
FLOOD_KEY, LIGHT_KEY, HURRIED_KEY = "sk-flood", "sk-light", "sk-hurried"
KEYS = (
    f"{FLOOD_KEY} tenant=flood",
    f"{LIGHT_KEY} tenant=light",
    f"{HURRIED_KEY} tenant=flood slo_ttft_ms=100",  # a default deadline from the key file
)
FLOOD = 24


@pytest.fixture(scope="module")
def gateway(default_model_dir):
    tokenizer = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    config = EngineConfig(
        model=str(default_model_dir),
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=2,
        scheduling_policy="fair",
    )
    [engine] = [ServerThread(s) for s in simulated_services(config, COST, "127.0.0.1", 0, 1)]
    server = GatewayThread(
        f"127.0.0.1:{engine.port}",
        f"127.0.0.1:{tokenizer.port}",
        GatewayConfig(api_keys=KEYS, trust_tenant_header=True),
    )
    server.engine = engine.service.engine.engine  # its steps slowed by send_flood
    yield server
    server.close()
    engine.close()
    tokenizer.close()


def body(max_tokens: int = 8, priority: int = 0) -> dict:
    return {
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "priority": priority,
    }


def waiting(url: str) -> float:
    return read_metrics(url)["folio_num_requests_waiting"]


def pace(engine: LLMEngine, cost: StepCostModel) -> None:
    """The simulated engine's steps take `cost`'s time, and its scheduler expects as much: its
    measured steps then match the model, so deadlines are judged by 20 ms steps again after
    the slow ones (not by a ratio learnt from them)."""
    assert isinstance(engine.executor, SimulatedExecutor)
    engine.executor.cost = cost
    engine.step_cost.model = cost


async def send_flood(
    gateway, send: Callable[[int], Coroutine[Any, Any, Any]]
) -> list[asyncio.Task]:
    """The flood's requests (`send(i)` for each), sent while the engine's steps are slow;
    returned once all but a few of them wait in the engine (two run) and its steps take 20 ms
    again."""
    pace(gateway.engine, ARRIVING)
    try:
        flood = [asyncio.create_task(send(i)) for i in range(FLOOD)]
        await asyncio.to_thread(
            wait_until, lambda: waiting(gateway.url) >= FLOOD - 4, "the flood to queue", TIMEOUT
        )
    finally:
        pace(gateway.engine, COST)
    # The engine takes requests in between steps: the slow step under way ends first, or a
    # request sent now would spend its deadline waiting for it.
    await asyncio.sleep(ARRIVING.fixed_seconds)
    return flood


def grpc_chat(gateway, key: str, max_tokens: int = 8, **level) -> list[gateway_pb2.ChatResponse]:
    """A gRPC Chat call as `key`, asking the ServiceLevel `level`."""
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)
    request = gateway_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content="Say something.")],
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        service_level=gateway_pb2.ServiceLevel(**level),
    )
    return list(stub.Chat(request, metadata=(("authorization", f"Bearer {key}"),), timeout=TIMEOUT))


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_a_flooding_key_does_not_hold_up_another(gateway, front):
    """Over gRPC the light requests come with the flood's key, the tenant named in their
    ServiceLevel, and a batch-lane call of the light key waits for the flood to be admitted."""
    url = gateway.url
    finished: list[str] = []
    sent_at: list[int] = []  # per light request: how many requests had ended when it was sent

    async def send(client: httpx.AsyncClient, key: str, name: str) -> None:
        if front == "grpc" and name.startswith("light"):
            await asyncio.to_thread(grpc_chat, gateway, FLOOD_KEY, tenant="light")
        else:
            response = await client.post(
                url + "/v1/chat/completions",
                json=body(),
                headers={"authorization": f"Bearer {key}"},
            )
            assert response.status_code == 200, response.text
        finished.append(name)

    async def send_batch() -> None:
        batch = gateway_pb2.PRIORITY_CLASS_BATCH
        await asyncio.to_thread(grpc_chat, gateway, LIGHT_KEY, priority_class=batch)
        finished.append("batch")

    async def run() -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            # The flood is queued in the engine before the light key asks anything.
            flood = await send_flood(gateway, lambda i: send(client, FLOOD_KEY, f"flood{i}"))
            if front == "grpc":
                flood.append(asyncio.create_task(send_batch()))
            for i in range(3):  # one after the other, as an interactive user would
                sent_at.append(len(finished))
                await send(client, LIGHT_KEY, f"light{i}")
            await asyncio.gather(*flood)

    asyncio.run(run())
    # Under fcfs each light request would wait behind the whole queue (20 and more flood
    # requests ending first); the fair policy lets each in at the next free slot, so only the
    # two running when it came and one started beside it end before it.
    ahead = [finished.index(f"light{i}") - sent_at[i] for i in range(3)]
    assert max(ahead) <= 4, (ahead, finished)
    if front == "grpc":
        # The batch lane runs once no interactive request waits: beside the flood's last.
        assert finished.index("batch") >= len(finished) - 2, finished
    assert len(finished) == FLOOD + 3 + (front == "grpc")


def test_deadlines_refused_when_unmeetable_and_malformed_named(gateway):
    url = gateway.url
    light = {"authorization": f"Bearer {LIGHT_KEY}"}
    response = httpx.post(
        url + "/v1/chat/completions",
        json=body(),
        headers={**light, "x-slo-ttft-ms": "soon"},
        timeout=TIMEOUT,
    )
    check_error(response, 400, "x-slo-ttft-ms")
    # Below one step of this model (20 ms): never meetable, refused with the reason.
    response = httpx.post(
        url + "/v1/chat/completions", json=body(), headers={**light, "x-slo-ttft-ms": "5"}
    )
    error = check_error(response, 400, "slo_ttft_ms")
    assert "below one engine step" in error["message"]
    # The gRPC API's ServiceLevel alike: INVALID_ARGUMENT naming the field.
    for level, reason in (({"slo_ttft_ms": -1}, "positive"), ({"slo_ttft_ms": 5}, "below one")):
        with pytest.raises(grpc.RpcError) as refused:
            grpc_chat(gateway, LIGHT_KEY, **level)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "slo_ttft_ms" in refused.value.details() and reason in refused.value.details()

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            flood_headers = {"authorization": f"Bearer {FLOOD_KEY}"}
            # More urgent than what follows: a request with a deadline would otherwise run
            # ahead of a queue without deadlines, and meet it.
            urgent = body(priority=-1)
            flood = await send_flood(
                gateway,
                lambda _: client.post(
                    url + "/v1/chat/completions", json=urgent, headers=flood_headers
                ),
            )

            # The flood's next request waits behind its queue: 100 ms (the hurried key's
            # default, or a header's) cannot be met. The three are sent at once, so that each
            # meets the queue whole (one after another, the last could meet a queue the flood
            # had drained for two round trips).
            def grpc_outcome() -> grpc.RpcError | None:
                try:
                    grpc_chat(gateway, FLOOD_KEY, slo_ttft_ms=100)
                except grpc.RpcError as failure:
                    return failure
                return None

            by_key, by_header, by_grpc = await asyncio.gather(
                client.post(
                    url + "/v1/chat/completions",
                    json=body(),
                    headers={"authorization": f"Bearer {HURRIED_KEY}"},
                ),
                client.post(
                    url + "/v1/chat/completions",
                    json=body(),
                    headers={**flood_headers, "x-slo-ttft-ms": "100"},
                ),
                asyncio.to_thread(grpc_outcome),
            )
            await asyncio.gather(*flood)
            return [by_key, by_header], by_grpc

    responses, by_grpc = asyncio.run(run())
    for refused in responses:
        error = check_error(refused, 429, None)
        assert "slo_ttft_ms leaves" in error["message"] and "expected in" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
    assert by_grpc is not None and by_grpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "slo_ttft_ms leaves" in by_grpc.details()
    assert int(dict(by_grpc.trailing_metadata())["retry-after"]) >= 1


def test_a_request_past_its_total_deadline_ends_with_504(gateway):
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body(max_tokens=1000),
        headers={"authorization": f"Bearer {LIGHT_KEY}", "x-slo-total-ms": "300"},
        timeout=TIMEOUT,
    )
    error = check_error(response, 504, None)
    assert "total deadline" in error["message"]
    with pytest.raises(grpc.RpcError) as ended:
        grpc_chat(gateway, LIGHT_KEY, max_tokens=1000, slo_total_ms=300)
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "total deadline" in ended.value.details()
    assert read_metrics(gateway.url)['folio_requests_total{finish_reason="deadline"}'] == 2


def test_key_file_settings_are_read_and_bad_ones_named(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# tenants\nsk-a tenant=acme weight=3 slo_ttft_ms=500\nsk-b\n")
    entries = load_api_keys([], str(key_file), {})
    assert [key_of(e) for e in entries] == ["sk-a", "sk-b"]
    assert key_settings(entries[0]) == KeySettings("acme", 3.0, 500.0, None)
    levels = ServiceLevels(GatewayConfig(api_keys=entries))
    assert levels.of("key-0", {}) == ServiceLevel("acme", 3.0, 500.0, None)
    assert levels.of("key-1", {"x-slo-total-ms": "900", "x-tenant": "other"}) == ServiceLevel(
        "key-1", 1.0, None, 900.0
    )
    trusting = ServiceLevels(GatewayConfig(api_keys=entries, trust_tenant_header=True))
    assert trusting.of("key-1", {"x-tenant": "acme"}).weight == 3.0
    # A gRPC call's ServiceLevel: a deadline over the key's default; a tenant only if trusted.
    asked = AskedLevel(ttft_ms=200.0, tenant="acme")
    assert levels.of_call("key-0", asked) == ServiceLevel("acme", 3.0, 200.0, None)
    assert levels.of_call("key-1", asked).tenant == "key-1"
    assert trusting.of_call("key-1", asked) == ServiceLevel("acme", 3.0, 200.0, None)
    for line, named in (("sk-c weight=-1", "weight"), ("sk-c speed=2", "speed=2")):
        key_file.write_text(line + "\n")
        with pytest.raises(ValueError, match=f"line 1.*{named}") as refused:
            load_api_keys([], str(key_file), {})
        assert "sk-c" not in str(refused.value)  # a key is never echoed
