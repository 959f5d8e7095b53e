"""Cancellation frees the engine: clients that give up (HTTP clients timing out, gRPC calls
cancelled or past their deadline, whole engine Generate streams cancelled) and stop strings
that match in the gateway leave nothing running or waiting, and the KV cache back at its idle
level within seconds; the server then answers a new request normally.

Every abandoned request asks for far more tokens than can be generated before its client
leaves (min_tokens = max_tokens), so only an abort can end it in time."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, gateway_pb2, gateway_pb2_grpc

from gateway_helpers import engine_stats, read_metrics, wait_for_idle_engine
from grpc_helpers import TIMEOUT, RequestStream

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
UNFINISHABLE = 900  # tokens: minutes of work at the load these tests make
CLIENT_TIMEOUT = 0.5
FREED_WITHIN = 5.0  # seconds, from the last client's departure


@pytest.fixture(scope="module")
def idle_kv_usage(gateway, engine_stub) -> float:
    """The KV cache usage with nothing running (cached prefixes may hold blocks), once the
    gateway is warm (its channels open, the model known), so that a flood of requests reaches
    the engine within the clients' patience."""
    check_a_new_request_completes(gateway)
    stats = engine_stats(engine_stub)
    assert stats.num_running == 0 and stats.num_waiting == 0
    return stats.kv_cache_usage


def unfinishable(**fields) -> dict:
    return {"model": MODEL, "max_tokens": UNFINISHABLE, "min_tokens": UNFINISHABLE, **fields}


def unfinishable_params() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=UNFINISHABLE, min_tokens=UNFINISHABLE)


def check_a_new_request_completes(gateway) -> None:
    response = httpx.post(
        gateway.url + "/v1/completions",
        timeout=TIMEOUT,
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "min_tokens": 5},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


async def leave_after(
    client: httpx.AsyncClient,
    route: str,
    body: dict,
    patience: float = CLIENT_TIMEOUT,
    at_first_chunk: bool = False,
) -> str:
    """Stream a request and give up after `patience` seconds (or at its first chunk); how it
    ended."""
    try:
        async with asyncio.timeout(patience):
            async with client.stream("POST", route, json=body, timeout=patience) as response:
                if response.status_code != 200:
                    return f"status {response.status_code}: {(await response.aread())[:200]!r}"
                async for _ in response.aiter_raw():
                    if at_first_chunk:
                        return "gave up"
    except (TimeoutError, httpx.TimeoutException):
        return "gave up"
    return "finished"


def test_200_http_clients_that_time_out_free_the_engine(gateway, tokenizer, idle_kv_usage):
    requests = 200
    # Half the prompts as token ids: no tokenizer call, so more of them reach the engine
    # before their clients leave.
    prompt_ids = tokenizer.encode(PROMPT)
    bodies = [
        unfinishable(prompt=prompt_ids, stream=True)
        if i % 2
        else unfinishable(messages=CHAT, stream=True)
        for i in range(requests)
    ]
    before = read_metrics(gateway.url)

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=gateway.url, timeout=CLIENT_TIMEOUT, limits=limits
        ) as client:
            return await asyncio.gather(
                *(
                    leave_after(
                        client,
                        "/v1/completions" if "prompt" in body else "/v1/chat/completions",
                        body,
                    )
                    for body in bodies
                ),
                # One that surely ran in the engine: it leaves at its first token, however
                # loaded the machine (the others may all leave before any step).
                leave_after(
                    client,
                    "/v1/completions",
                    bodies[1],
                    patience=TIMEOUT,
                    at_first_chunk=True,
                ),
            )

    outcomes = asyncio.run(run())
    assert outcomes == ["gave up"] * (requests + 1), sorted(set(outcomes))
    samples = wait_for_idle_engine(gateway.url, idle_kv_usage, FREED_WITHIN)
    # Requests reached the engine and ran there before their clients left (on a loaded
    # machine most leave while queued in the engine, or before their prompts got there).
    steps = "folio_engine_steps_total"
    assert samples[steps] > before[steps]
    check_a_new_request_completes(gateway)


def test_grpc_calls_cancelled_or_past_their_deadline_free_the_engine(gateway, idle_kv_usage):
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)
    generate = gateway_pb2.GatewayServiceGenerateRequest(
        prompt=PROMPT, sampling_params=unfinishable_params()
    )
    chat = gateway_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(**m) for m in CHAT], sampling_params=unfinishable_params()
    )
    # Half are cancelled by the client (the first after its first text, the others before
    # any), half end by their deadline (the server sees DEADLINE_EXCEEDED).
    # One that surely runs in the engine: alone at first, so that it is not left waiting for a
    # slot behind the others (which run until they are cancelled below).
    cancelled = [stub.Generate(generate, timeout=TIMEOUT)]
    next(cancelled[0])
    cancelled += [stub.Generate(generate, timeout=TIMEOUT) for _ in range(24)]
    cancelled += [stub.Chat(chat, timeout=TIMEOUT) for _ in range(25)]
    expiring = [stub.Generate(generate, timeout=CLIENT_TIMEOUT) for _ in range(25)]
    expiring += [stub.Chat(chat, timeout=CLIENT_TIMEOUT) for _ in range(25)]
    time.sleep(CLIENT_TIMEOUT)
    for call in cancelled:
        call.cancel()
    for call in expiring + cancelled:
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        assert ended.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
    wait_for_idle_engine(gateway.url, idle_kv_usage, FREED_WITHIN)
    check_a_new_request_completes(gateway)


def test_cancelled_engine_generate_streams_free_the_engine(gateway, engine_stub, idle_kv_usage):
    # Engine clients other than the gateway: each stream carries several requests, and
    # cancelling the stream must abort all of them, running or still waiting.
    streams = []
    for s in range(8):
        requests = RequestStream()
        for r in range(8):
            requests.send(
                engine_pb2.GenerateRequest(
                    add=engine_pb2.EngineRequest(
                        request_id=f"cancelled-stream-{s}-{r}-{time.monotonic_ns()}",
                        prompt_token_ids=[1, 2, 3, 4 + r],
                        sampling_params=unfinishable_params(),
                    )
                )
            )
        streams.append((requests, engine_stub.Generate(iter(requests), timeout=TIMEOUT)))
    next(streams[0][1])  # the engine has started on them
    assert engine_stats(engine_stub).num_running > 0
    for requests, call in streams:
        call.cancel()
        requests.close()
    wait_for_idle_engine(gateway.url, idle_kv_usage, FREED_WITHIN)
    check_a_new_request_completes(gateway)


def test_stop_strings_matched_in_the_gateway_abort_their_engine_requests(
    gateway, engine_stub, idle_kv_usage
):
    # Greedy text of ignore_eos requests of up to UNFINISHABLE tokens; a space or a new line
    # comes within a few tokens, and then the engine must stop, not generate to max_tokens.
    stop = [" ", "\n"]
    http_body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": UNFINISHABLE,
        "ignore_eos": True,
        "stop": stop,
        "stream_options": {"include_usage": True},
    }
    grpc_request = gateway_pb2.GatewayServiceGenerateRequest(
        prompt=PROMPT,
        stop=stop,
        sampling_params=common_pb2.SamplingParams(max_tokens=UNFINISHABLE, ignore_eos=True),
    )
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)
    before = read_metrics(gateway.url)

    async def over_http(client: httpx.AsyncClient, stream: bool) -> tuple[str, int]:
        response = await client.post("/v1/completions", json={**http_body, "stream": stream})
        assert response.status_code == 200, response.text
        if not stream:
            body = response.json()
            return body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]
        events = [
            line.removeprefix("data: ")
            for line in response.text.splitlines()
            if line.startswith("data: ")
        ]
        assert events[-1] == "[DONE]"
        last_choice = httpx.Response(200, content=events[-3]).json()["choices"][0]
        usage = httpx.Response(200, content=events[-2]).json()["usage"]
        return last_choice["finish_reason"], usage["completion_tokens"]

    def over_grpc() -> tuple[str, int]:
        last = list(stub.Generate(grpc_request, timeout=TIMEOUT))[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP
        return "stop", last.usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(
                *(over_http(client, stream=i % 2 == 0) for i in range(24)),
                *(asyncio.to_thread(over_grpc) for _ in range(8)),
            )

    outcomes = asyncio.run(run())
    assert {reason for reason, _ in outcomes} == {"stop"}
    assert max(tokens for _, tokens in outcomes) < 50
    # Each answer came after its engine request was aborted and its blocks freed: nothing
    # is left the moment the last answer is in, without waiting.
    stats = engine_stats(engine_stub)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.kv_cache_usage == idle_kv_usage
    after = read_metrics(gateway.url)
    key = 'folio_requests_total{finish_reason="stop"}'
    assert after[key] - before.get(key, 0) == len(outcomes)
