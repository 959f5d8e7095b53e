"""The gateway's public gRPC text API (folio.v1.GatewayService) with a plain Python grpc client:
Generate and Chat stream the same text as the HTTP routes, stop strings, logprobs, errors as
status codes, a cancelled call aborts its engine request, health and reflection."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway_helpers import engine_stats
from grpc_helpers import TIMEOUT

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def stub(gateway) -> gateway_pb2_grpc.GatewayServiceStub:
    return gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)


def greedy(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def http_post(gateway, route: str, body: dict) -> dict:
    return httpx.post(gateway.url + route, json=body, timeout=TIMEOUT).json()


def test_generate_streams_the_text_of_the_http_completion(stub, gateway, tokenizer):
    responses = list(
        stub.Generate(
            gateway_pb2.GatewayServiceGenerateRequest(
                prompt=PROMPT, sampling_params=greedy(16, ignore_eos=True)
            ),
            timeout=TIMEOUT,
        )
    )
    http = http_post(
        gateway,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
    )
    assert len(responses) > 3
    assert "".join(r.text for r in responses) == http["choices"][0]["text"]
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert last.usage.completion_tokens == 16
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])


def test_chat_streams_the_text_of_the_http_chat(stub, gateway, tokenizer):
    request = gateway_pb2.ChatRequest(
        model="SmolLM2-135M-Instruct",
        sampling_params=greedy(12),
        messages=[common_pb2.ChatMessage(**m) for m in CHAT],
    )
    responses = list(stub.Chat(request, timeout=TIMEOUT))
    http = http_post(
        gateway, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    )
    assert "".join(r.text for r in responses) == http["choices"][0]["message"]["content"]
    assert responses[-1].usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))


def test_stop_strings_and_logprobs(stub, engine_stub):
    params = greedy(30, ignore_eos=True)
    full = "".join(
        r.text
        for r in stub.Generate(
            gateway_pb2.GatewayServiceGenerateRequest(prompt=PROMPT, sampling_params=params),
            timeout=TIMEOUT,
        )
    )
    stop = full.split()[3]
    params.max_tokens = 500
    params.logprobs = 2
    responses = list(
        stub.Generate(
            gateway_pb2.GatewayServiceGenerateRequest(
                prompt=PROMPT, sampling_params=params, stop=[stop], include_stop_str_in_output=True
            ),
            timeout=TIMEOUT,
        )
    )
    assert "".join(r.text for r in responses) == full[: full.index(stop) + len(stop)]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert len(logprobs) == responses[-1].usage.completion_tokens < 30
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert engine_stats(engine_stub).num_running == 0


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (gateway_pb2.GatewayServiceGenerateRequest(prompt="Hi", model="other"), "model"),
        (
            gateway_pb2.GatewayServiceGenerateRequest(
                prompt="Hi", sampling_params=common_pb2.SamplingParams(top_p=2.0)
            ),
            "top_p",
        ),
        (
            gateway_pb2.GatewayServiceGenerateRequest(
                prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=100000)
            ),
            "max_tokens",
        ),
        (gateway_pb2.GatewayServiceGenerateRequest(prompt=""), "prompt"),
        (gateway_pb2.GatewayServiceGenerateRequest(prompt="Hi", stop=[""]), "stop"),
    ],
)
def test_bad_requests_are_invalid_argument(stub, request_, needle):
    with pytest.raises(grpc.RpcError) as failure:
        list(stub.Generate(request_, timeout=TIMEOUT))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in failure.value.details()


def test_a_cancelled_call_aborts_its_engine_request(stub, engine_stub):
    call = stub.Generate(
        gateway_pb2.GatewayServiceGenerateRequest(
            prompt=PROMPT, sampling_params=greedy(900, ignore_eos=True)
        ),
        timeout=TIMEOUT,
    )
    next(call)
    assert engine_stats(engine_stub).num_running == 1
    call.cancel()
    deadline = time.monotonic() + 2
    while engine_stats(engine_stub).num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine_stats(engine_stub).num_running == 0


def test_health_and_reflection(gateway):
    health = health_pb2_grpc.HealthStub(gateway.grpc_channel)
    status = health.Check(
        health_pb2.HealthCheckRequest(service="folio.v1.GatewayService"), timeout=TIMEOUT
    ).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(gateway.grpc_channel)
    answer = next(
        reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
        )
    )
    names = {s.name for s in answer.list_services_response.service}
    assert "folio.v1.GatewayService" in names
