"""The gateway when things are not fine: `folio gateway` as a real process (the agreed ready
line, health, the served model name, and a SIGTERM drain: new requests 503, the request in
flight finishes, exit 0); services that are down (503, not 500); a full engine queue (429)."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import threading
import time

import httpx
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc

from common.config import EngineConfig
from engine.simulated import StepCostModel
from gateway_helpers import ENGINE_ARGS, GatewayThread, engine_stats, spawn_gateway
from grpc_helpers import TIMEOUT, RequestStream, ServerThread
from polling import wait_until
from services.engine.server import EngineService
from services.engine.simulate import simulated_services

DRAIN_SECONDS = 120
FAST = StepCostModel(fixed_seconds=0.001, prefill_token_seconds=0.0, decode_sequence_seconds=0.0)


def test_folio_gateway_serves_then_drains_on_sigterm(services):
    engine, tokenizer = services
    process = spawn_gateway(
        engine.port,
        tokenizer.port,
        "--served-model-name",  # vLLM's form: the names after one flag
        "folio-test",
        "folio-alias",
        # A generous drain: on a loaded 2-core machine the tokens below can take a minute.
        "--drain-seconds",
        str(DRAIN_SECONDS),
    )
    try:
        line = process.stdout.readline()
        match = re.fullmatch(
            r"folio: gateway listening on http://127\.0\.0\.1:(\d+) \(gRPC 127\.0\.0\.1:(\d+)\)\n",
            line,
        )
        assert match, f"unexpected first line {line!r}: {process.stderr.read()}"
        url = f"http://127.0.0.1:{match[1]}"
        assert httpx.get(url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
        models = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()
        assert [m["id"] for m in models["data"]] == ["folio-test", "folio-alias"]
        # Either name serves the model; the answer says the one the request used.
        for name, said in ((None, "folio-test"), ("folio-alias", "folio-alias")):
            body = {"prompt": "Hi", "max_tokens": 1, **({"model": name} if name else {})}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT).json()
            assert answer["model"] == said, answer
        unknown = httpx.post(
            url + "/v1/completions", json={"prompt": "Hi", "model": "other"}, timeout=TIMEOUT
        )
        assert unknown.status_code == 404
        assert "serves 'folio-test' or 'folio-alias'" in unknown.json()["error"]["message"]

        # A streamed request in flight when SIGTERM comes must still finish.
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {
                "model": "folio-test",
                "prompt": "Once upon a time",
                "max_tokens": 60,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, timeout=TIMEOUT
            ) as response:
                for event in response.iter_lines():
                    if event:
                        events.append(event)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(TIMEOUT)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(url + "/health", timeout=TIMEOUT).status_code != 503:
            assert time.monotonic() < deadline, "SIGTERM did not start draining"
            time.sleep(0.01)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=TIMEOUT)
        assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
        reader.join(DRAIN_SECONDS)
        assert not reader.is_alive(), "the stream did not end within the drain"
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in events[-2]
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_gateway_without_its_services_answers_503():
    nowhere = f"127.0.0.1:{free_port()}"
    gateway = GatewayThread(nowhere, nowhere)
    try:
        with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http:
            assert http.get("/health").status_code == 503
            for response in (
                http.get("/v1/models"),
                http.post("/v1/completions", json={"prompt": "Hi"}),
                http.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}
                ),
            ):
                assert response.status_code == 503, response.text
                assert response.json()["error"]["type"] == "service_unavailable"
            metrics = http.get("/metrics")
            assert metrics.status_code == 200 and "folio_generation_tokens_total" in metrics.text
    finally:
        gateway.close()


def test_a_down_engine_is_a_plain_503_with_retry_after_and_its_detail_is_logged(services, caplog):
    _, tokenizer = services
    port = free_port()
    gateway = GatewayThread(f"127.0.0.1:{port}", f"127.0.0.1:{tokenizer.port}")
    try:
        with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http:
            for response in (
                http.get("/v1/models"),
                http.post("/v1/completions", json={"prompt": "Hi"}),
                http.post("/v1/completions", json={"prompt": "Hi", "stream": True}),
            ):
                assert response.status_code == 503, response.text
                # Nothing of the engine's address or of gRPC's own words reaches the client.
                assert response.json()["error"]["message"] == "engine unavailable"
                assert int(response.headers["retry-after"]) >= 1
        assert any(
            str(port) in record.getMessage() and record.levelno >= logging.WARNING
            for record in caplog.records
        ), "the engine's address and gRPC's detail are not in the log"
    finally:
        gateway.close()


def test_closing_the_gateway_is_no_engine_outage_in_the_log(services, caplog):
    engine, tokenizer = services
    gateway = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
    try:
        body = {"prompt": "Hi", "max_tokens": 1}
        assert httpx.post(gateway.url + "/v1/completions", json=body, timeout=TIMEOUT).is_success
    finally:
        gateway.close()  # its Generate stream ends with it
    # The gateway's own records only: asyncio may log other tests' leftovers meanwhile.
    warnings = [
        r for r in caplog.records if r.name.startswith("gateway.") and r.levelno >= logging.WARNING
    ]
    assert not warnings, caplog.text


def test_a_full_engine_queue_is_429(default_model_dir, services):
    _, tokenizer = services
    args = dict(ENGINE_ARGS, max_num_seqs=1, max_waiting_requests=1)
    engine = ServerThread(
        EngineService(EngineConfig(model=str(default_model_dir), **args), "127.0.0.1", 0)
    )
    gateway = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
    # Fill the engine behind the gateway's back: one request running, then one waiting. The
    # second goes in only once the first runs: sent together, both could land in the one-slot
    # waiting queue in the same step and the second would be refused.
    params = common_pb2.SamplingParams(max_tokens=900, ignore_eos=True)
    stub = engine_pb2_grpc.EngineServiceStub(engine.channel)
    requests = RequestStream()
    busy = stub.Generate(iter(requests), timeout=TIMEOUT)

    def add(name: str) -> None:
        requests.send(
            engine_pb2.GenerateRequest(
                add=engine_pb2.EngineRequest(
                    request_id=name, prompt_token_ids=[1, 2, 3], sampling_params=params
                )
            )
        )

    try:
        add("running")
        next(busy)  # it has produced a token: it holds the running slot
        add("waiting")
        deadline = time.monotonic() + TIMEOUT
        while (stats := engine_stats(stub)).num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (stats.num_running, stats.num_waiting) == (1, 1)
        with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http:
            for stream in (False, True):
                response = http.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
                assert response.status_code == 429, response.text
                assert response.json()["error"]["type"] == "rate_limit_error"
    finally:
        requests.close()
        busy.cancel()
        gateway.close()
        engine.close()


def test_a_broken_generate_stream_leaves_no_task_behind(default_model_dir, services):
    """When the engine goes away the Generate stream ends, and its sending side with it: grpc's
    task that sends the stream's messages must not stay suspended on the outbox past the
    gateway's event loop, where the garbage collector would later finalize it at a random point
    of another test (a RuntimeError about a closed loop, raised inside whatever the collector
    interrupted: once, hypothesis' ast.parse)."""
    _, tokenizer = services
    config = EngineConfig(model=str(default_model_dir), block_size=16, num_kv_blocks=256)
    [engine] = [ServerThread(s) for s in simulated_services(config, FAST, "127.0.0.1", 0, 1)]
    gateway = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
    try:
        body = {"prompt": "Hi", "max_tokens": 1}
        assert httpx.post(gateway.url + "/v1/completions", json=body, timeout=TIMEOUT).is_success
        engine.close()  # the stream breaks
        wait_until(
            lambda: httpx.get(gateway.url + "/health", timeout=TIMEOUT).status_code == 503,
            "the gateway to see its engine gone",
            seconds=TIMEOUT,
        )
    finally:
        gateway.close()
    left = [task for task in asyncio.all_tasks(gateway.loop) if not task.done()]
    assert not left, left


def test_an_engine_outage_is_one_warning_and_its_end_one_line(default_model_dir, services, caplog):
    """Every call that finds the engine down (requests, /health, /metrics) would otherwise log a
    warning of its own: an outage is one warning as it starts, one line as the engine answers
    again, and the next outage is a warning again."""
    caplog.set_level(logging.DEBUG, logger="gateway.engines.clients")
    _, tokenizer = services
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = EngineConfig(model=str(default_model_dir), block_size=16, num_kv_blocks=256)

    def said(words: str, level: int) -> int:
        return sum(
            1
            for r in caplog.records
            if r.name == "gateway.engines.clients"
            and r.levelno == level
            and f"engine at {address} {words}" in r.getMessage()
        )

    gateway = GatewayThread(address, f"127.0.0.1:{tokenizer.port}")
    engine = None
    try:
        with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http:
            for path in ("/v1/models", "/health", "/metrics", "/v1/models"):
                http.get(path)
            assert said("is unavailable", logging.WARNING) == 1, caplog.text
            assert said("is unavailable", logging.DEBUG) >= 2, caplog.text

            [service] = simulated_services(config, FAST, "127.0.0.1", port, 1)
            engine = ServerThread(service)
            wait_until(
                lambda: http.get("/health").status_code == 200, "the engine back", seconds=TIMEOUT
            )
            assert said("answers again", logging.INFO) == 1, caplog.text

            engine.close()
            engine = None
            wait_until(
                lambda: http.get("/v1/models").status_code == 503,
                "the engine gone",
                seconds=TIMEOUT,
            )
            assert said("is unavailable", logging.WARNING) == 2, caplog.text
    finally:
        if engine is not None:
            engine.close()
        gateway.close()
