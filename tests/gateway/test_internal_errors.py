"""Failures that are the gateway's own (a bug in it, injected here into the real gateway), not
the client's and not an engine's: the client gets a 500, the server log gets the traceback,
whether the failure comes before the answer, in the middle of a stream, or while the outputs
of an engine step are processed (those requests are aborted on the engine, the replica stays in
rotation and serves on)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import traceback

import grpc
import httpx
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc

import polling
from common.config import EngineConfig, GatewayConfig
from common.errors import InternalError
from common.sampling_params import SamplingParams
from engine.simulated import StepCostModel
from gateway.engines.clients import EngineClient
from gateway.engines.session import ReplicaSession
from gateway.front import grpc_service
from gateway.metrics import Metrics
from gateway.openai import completions
from gateway.openai.responses import translate
from gateway.pipeline.model_text import ModelText
from gateway.pipeline.output_processor import OutputProcessor, TrackedRequest
from gateway.pipeline.text import TextRequest
from gateway_helpers import GatewayThread, engine_stats, read_metrics
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.simulate import simulated_services
from services.tokenizer.server import TokenizerService

BUG = "injected: a bug in the gateway"
# A stop string no answer holds: it marks the requests whose engine outputs the injected bug
# breaks (a sequence's detokenizer takes its stop strings with its first tokens).
MARKER = "<fault-marker>"
# Slow steps: a request left running in the engine would run for minutes.
SLOW = StepCostModel(fixed_seconds=0.05, prefill_token_seconds=0.0, decode_sequence_seconds=0.0)

wait_until = functools.partial(polling.wait_until, seconds=TIMEOUT)


def raise_bug(*args: object, exception: type[Exception] = RuntimeError, **kwargs: object) -> None:
    raise exception(BUG)


def logged_with_traceback(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The error records whose traceback is the injected bug's."""
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR
        and r.exc_info
        and BUG in "".join(traceback.format_exception(*r.exc_info))
    ]


def test_an_internal_value_error_is_a_logged_500_not_the_clients_fault(
    gateway, monkeypatch, caplog
):
    # A ValueError is no validation error: a bug building the answer must not be a 400.
    monkeypatch.setattr(completions, "_usage", functools.partial(raise_bug, exception=ValueError))
    response = httpx.post(
        gateway.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT
    )
    assert response.status_code == 500, response.text
    assert response.json()["error"]["type"] == "server_error"
    assert logged_with_traceback(caplog)


def test_an_internal_value_error_in_the_grpc_api_is_a_logged_internal(gateway, monkeypatch, caplog):
    monkeypatch.setattr(
        grpc_service, "text_request", functools.partial(raise_bug, exception=ValueError)
    )
    request = gateway_pb2.GatewayServiceGenerateRequest(
        prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=2)
    )
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)
    with pytest.raises(grpc.RpcError) as failure:
        list(stub.Generate(request, timeout=TIMEOUT))
    assert failure.value.code() == grpc.StatusCode.INTERNAL
    assert logged_with_traceback(caplog)


# (route, body, the module and its function that fail at the stream's end)
STREAMS = [
    (
        "/v1/completions",
        {
            "prompt": "Hi",
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        completions,
        "_usage",  # the usage chunk comes last
    ),
    (
        "/v1/responses",
        {"input": "Hi", "max_output_tokens": 2, "stream": True},
        translate,
        "response_usage",  # the usage comes with the last event
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "module", "name"), STREAMS, ids=["completions", "responses"]
)
def test_an_error_after_the_stream_started_is_logged(
    gateway, monkeypatch, caplog, route, body, module, name
):
    monkeypatch.setattr(module, name, raise_bug)
    with httpx.stream("POST", gateway.url + route, json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    error = events[-1].get("error", events[-1])  # the Responses API's error event is flat
    assert BUG in error["message"]
    assert logged_with_traceback(caplog)


@pytest.fixture
def replicas(default_model_dir):
    """Two slow simulated engine replicas and the real tokenizer service."""
    config = EngineConfig(model=str(default_model_dir), block_size=16, num_kv_blocks=256)
    engines = [ServerThread(s) for s in simulated_services(config, SLOW, "127.0.0.1", 0, 2)]
    tokenizer = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    yield engines, tokenizer
    for server in (*engines, tokenizer):
        server.close()


def test_a_bug_processing_engine_outputs_fails_its_requests_not_the_replica(
    replicas, monkeypatch, caplog
):
    engines, tokenizer = replicas
    detokenizer = ModelText.detokenizer

    def detokenizer_with_bug(self, request):
        # A sequence's detokenizer (with its stop strings) is made with its first tokens.
        if MARKER in request.stop:
            raise_bug()
        return detokenizer(self, request)

    monkeypatch.setattr(ModelText, "detokenizer", detokenizer_with_bug)
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    gateway = GatewayThread(
        addresses, f"127.0.0.1:{tokenizer.port}", GatewayConfig(routing_policy="round_robin")
    )
    try:
        with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http:
            body = {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True, "stop": [MARKER]}
            failed = http.post("/v1/completions", json=body)
            assert failed.status_code == 500, failed.text
            assert failed.json()["error"]["type"] == "server_error"
            # One bug, one traceback (where the step failed); the request's own record is a line.
            assert len(logged_with_traceback(caplog)) == 1, caplog.text
            assert "request failed: processing the engine's outputs failed" in caplog.text
            # Both replicas stay in rotation: the engine did nothing wrong.
            healthy = {
                key: value
                for key, value in read_metrics(gateway.url).items()
                if key.startswith("folio_replica_healthy")
            }
            assert list(healthy.values()) == [1.0, 1.0], healthy
            # The request does not run on in its engine.
            stubs = [engine_pb2_grpc.EngineServiceStub(e.channel) for e in engines]
            wait_until(
                lambda: not any(engine_stats(s).num_running for s in stubs),
                "the engines to abort the failed request",
            )
            # And the gateway serves on, on both replicas.
            for _ in addresses:
                ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert ok.status_code == 200, ok.text
    finally:
        gateway.close()


def step_with_bug(processor: OutputProcessor, outputs: object) -> None:
    """An output processor's step with a bug it lets out (it contains its own)."""
    raise_bug()


def test_a_bug_the_processor_lets_out_cancels_the_stream_and_keeps_the_replica(
    replicas, monkeypatch, caplog
):
    engine = replicas[0][0]
    monkeypatch.setattr(OutputProcessor, "process_outputs", step_with_bug)
    broken: list[bool] = []

    async def run() -> tuple[Exception, int, int]:
        client = EngineClient(f"127.0.0.1:{engine.port}")
        session = ReplicaSession(client, Metrics(), lambda _: False, lambda: broken.append(True))
        try:
            params = SamplingParams(max_tokens=3000, ignore_eos=True)
            # No model text: the bug comes before any text is made.
            request = TrackedRequest(
                "r", TextRequest([1, 2, 3], params), 1, 0, 0.0, asyncio.Queue(), None
            )
            session.submit(request, params, 0)
            error = await asyncio.wait_for(request.deltas.get(), TIMEOUT)
            # Its call was cancelled, which aborts its requests on the engine.
            deadline = asyncio.get_running_loop().time() + TIMEOUT
            while (running := (await client.stats()).num_running) and (
                asyncio.get_running_loop().time() < deadline
            ):
                await asyncio.sleep(0.05)
            return error, session.broken_streams, running
        finally:
            await session.close()
            await client.close()

    error, broken_streams, running = asyncio.run(run())
    assert isinstance(error, InternalError) and BUG in str(error)
    assert broken_streams == 0 and not broken  # the engine did nothing wrong
    assert running == 0
    assert logged_with_traceback(caplog)
