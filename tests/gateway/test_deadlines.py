"""Request timeouts and deadlines: an HTTP request past the gateway's --request-timeout is
aborted with 504 (or an error event once streaming), a gRPC call ends with DEADLINE_EXCEEDED at
its own deadline or the gateway's timeout, whichever is sooner, and in every case the engine
request is gone soon after. The deadline also reaches the tokenizer as the gRPC deadline of the
gateway's calls to it."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from common.config import GatewayConfig
from gateway_helpers import GatewayThread, check_error, wait_engine_idle
from grpc_helpers import TIMEOUT, ServerThread
from services.tokenizer.server import TokenizerService, TokenizerServicer

REQUEST_TIMEOUT = 2.0
SLACK = 1.0
# Far longer than any deadline here: only the deadline can end it.
LONG = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}


def long_generation() -> gateway_pb2.GatewayServiceGenerateRequest:
    return gateway_pb2.GatewayServiceGenerateRequest(
        prompt=LONG["prompt"],
        sampling_params=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def hurried(services):
    engine, tokenizer = services
    server = GatewayThread(
        f"127.0.0.1:{engine.port}",
        f"127.0.0.1:{tokenizer.port}",
        GatewayConfig(request_timeout=REQUEST_TIMEOUT),
    )
    yield server
    server.close()


def test_an_http_request_past_the_timeout_is_aborted_with_504(hurried, engine_stub):
    with httpx.Client(base_url=hurried.url, timeout=TIMEOUT) as http:
        error = check_error(http.post("/v1/completions", json=LONG), 504, None)
        assert error["code"] == "request_timeout" and "2 s" in error["message"]
        wait_engine_idle(engine_stub)

        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": LONG["prompt"]}],
                "max_tokens": 900,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response:
            if response.status_code == 200:
                events = [line for line in response.iter_lines() if line]
                assert events[-1] == "data: [DONE]"
                error = json.loads(events[-2].removeprefix("data: "))["error"]
                assert len(events) > 3  # tokens came before the timeout
            else:  # the machine was too slow to send the first token in time
                response.read()
                error = check_error(response, 504, None)
        assert error["code"] == "request_timeout"
        wait_engine_idle(engine_stub)


def test_a_grpc_deadline_ends_the_call_and_its_engine_request(gateway, engine_stub):
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)
    call = stub.Generate(long_generation(), timeout=REQUEST_TIMEOUT)
    with pytest.raises(grpc.RpcError) as failure:
        for _ in call:
            pass
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_engine_idle(engine_stub)


def test_the_gateway_timeout_bounds_grpc_calls_too(hurried, engine_stub):
    stub = gateway_pb2_grpc.GatewayServiceStub(hurried.grpc_channel)
    with pytest.raises(grpc.RpcError) as failure:
        list(stub.Generate(long_generation(), timeout=TIMEOUT))
    # The gateway ended it, not the client's own deadline.
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not finish within 2 s" in failure.value.details()
    wait_engine_idle(engine_stub)


def test_deadlines_reach_the_tokenizer(default_model_dir, services, monkeypatch):
    """The tokenizer sees, as its call's deadline, the gRPC caller's deadline or the gateway's
    request timeout; without them it would see the gateway's 30 s cap of unary calls."""
    seen: list[float | None] = []
    tokenize = TokenizerServicer.Tokenize

    async def recording_tokenize(self, request, context):
        seen.append(context.time_remaining())
        return await tokenize(self, request, context)

    # Before the service starts: gRPC binds the servicer's methods when it registers them.
    monkeypatch.setattr(TokenizerServicer, "Tokenize", recording_tokenize)
    tokenizer = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    engine, _ = services
    gateway = GatewayThread(
        f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}", GatewayConfig(request_timeout=20)
    )
    try:
        stub = gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)
        request = gateway_pb2.GatewayServiceGenerateRequest(
            prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=1)
        )
        # gRPC rounds a deadline on the wire up a little: SLACK.
        assert list(stub.Generate(request, timeout=5))
        assert 0 < seen[-1] <= 5 + SLACK
        assert list(stub.Generate(request, timeout=TIMEOUT))
        assert 5 + SLACK < seen[-1] <= 20 + SLACK
        response = httpx.post(
            gateway.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=TIMEOUT
        )
        assert response.status_code == 200, response.text
        assert 5 + SLACK < seen[-1] <= 20 + SLACK
        assert len(seen) == 3
    finally:
        gateway.close()
        tokenizer.close()
