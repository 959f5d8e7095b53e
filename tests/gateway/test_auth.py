"""API keys: with keys configured, every HTTP route but /health and /metrics answers a request
without a valid key with 401 and the OpenAI error body (the openai client raises
AuthenticationError), the gateway's gRPC API answers UNAUTHENTICATED, keys come from flags, the
environment or a file, and no key ever shows in a log line, an error message or a command line."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.auth import KeySet, bearer_token, load_api_keys
from common.config import GatewayConfig
from gateway_helpers import check_error, spawn_gateway, start_gateway
from grpc_helpers import TIMEOUT

KEYS = ("sk-folio-test-first-0123456789", "sk-folio-test-second-abcdef")
WRONG = "sk-folio-test-wrong-zyxwvu"
CHAT = [{"role": "user", "content": "Hi"}]
ROUTES = [
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/openapi.json", None),
]


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def keyed(services):
    server = start_gateway(services, api_keys=KEYS)
    yield server
    server.close()


def test_a_key_matches_only_itself():
    keys = KeySet(KEYS)
    assert [keys.identify(k) for k in KEYS] == ["key-0", "key-1"]
    for near in (KEYS[0][:-1], KEYS[0] + "0", KEYS[0].upper(), " " + KEYS[0], "", None):
        assert keys.identify(near) is None
    assert KeySet().identify(KEYS[0]) is None and not KeySet()
    assert bearer_token("Bearer  abc ") == bearer_token("bearer abc") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer") is None
    assert bearer_token("abc") is None and bearer_token(None) is None


def test_http_routes_need_a_valid_key(keyed):
    refused = (
        {},
        {"Authorization": f"Bearer {WRONG}"},
        {"Authorization": KEYS[0]},
        {"Authorization": f"Basic {KEYS[0]}"},
        {"Authorization": f"Bearer {KEYS[0]}x"},
    )
    with httpx.Client(base_url=keyed.url, timeout=TIMEOUT) as http:
        for headers in refused:
            for method, route, body in ROUTES:
                response = http.request(method, route, json=body, headers=headers)
                error = check_error(response, 401, None)
                assert error["code"] == "invalid_api_key", error
                assert response.headers["www-authenticate"] == "Bearer"
                assert WRONG not in response.text and KEYS[0] not in response.text
        # Probes and scrapers need no key.
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        for method, route, body in ROUTES:
            response = http.request(
                method, route, json=body, headers={"Authorization": f"Bearer {KEYS[1]}"}
            )
            assert response.status_code == 200, (route, response.text)
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}).is_success


def test_the_openai_client_sees_authentication_errors(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=WRONG, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as failure:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=2)
    assert failure.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[1], max_retries=0)
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=2
    )
    assert answer.usage.completion_tokens >= 1


def test_the_grpc_api_needs_a_valid_key(keyed):
    stub = gateway_pb2_grpc.GatewayServiceStub(keyed.grpc_channel)
    generate = gateway_pb2.GatewayServiceGenerateRequest(
        prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=2)
    )
    chat = gateway_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(**m) for m in CHAT],
        sampling_params=common_pb2.SamplingParams(max_tokens=2),
    )
    reflection = reflection_pb2_grpc.ServerReflectionStub(keyed.grpc_channel)
    list_services = reflection_pb2.ServerReflectionRequest(list_services="")
    calls = [
        lambda m: list(stub.Generate(generate, metadata=m, timeout=TIMEOUT)),
        lambda m: list(stub.Chat(chat, metadata=m, timeout=TIMEOUT)),
        lambda m: list(
            reflection.ServerReflectionInfo(iter([list_services]), metadata=m, timeout=TIMEOUT)
        ),
    ]
    for metadata in ((), bearer(WRONG), (("authorization", KEYS[0]),)):
        for call in calls:
            with pytest.raises(grpc.RpcError) as failure:
                call(metadata)
            assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in failure.value.details()
            assert WRONG not in failure.value.details()
    for key in KEYS:
        for call in calls:
            assert call(bearer(key))
    # Health stays open, as /health does.
    health = health_pb2_grpc.HealthStub(keyed.grpc_channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status
        == health_pb2.HealthCheckResponse.SERVING
    )


def test_health_and_metrics_can_need_the_key_too(services):
    server = start_gateway(services, api_keys=KEYS, protect_health_metrics=True)
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            for route in ("/health", "/metrics"):
                check_error(http.get(route), 401, None)
                response = http.get(route, headers={"Authorization": f"Bearer {KEYS[0]}"})
                assert response.status_code == 200, response.text
        health = health_pb2_grpc.HealthStub(server.grpc_channel)
        with pytest.raises(grpc.RpcError) as failure:
            health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (
            health.Check(
                health_pb2.HealthCheckRequest(), metadata=bearer(KEYS[1]), timeout=TIMEOUT
            ).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    finally:
        server.close()


def test_keys_come_from_flags_the_environment_and_a_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\n\nfile-key-1\n  file-key-2  \nflag-key\n")
    keys = load_api_keys(["flag-key"], str(key_file), {"FOLIO_API_KEYS": " env-a,env-b,,"})
    assert keys == ("flag-key", "env-a", "env-b", "file-key-1", "file-key-2")
    assert load_api_keys([], None, {}) == ()
    # A bad key is named by where it came from, never shown.
    secret = "sk-has space"
    for flags, environ, source in (
        ([secret], {}, "--api-key #1"),
        ([], {"FOLIO_API_KEYS": f"ok,{secret}"}, "FOLIO_API_KEYS"),
    ):
        with pytest.raises(ValueError, match=re.escape(source)) as failure:
            load_api_keys(flags, None, environ)
        assert secret not in str(failure.value)
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys([], str(tmp_path / "empty"), {})
    assert not any(k in repr(GatewayConfig(api_keys=KEYS)) + repr(KeySet(KEYS)) for k in KEYS)


def test_folio_gateway_reads_keys_from_its_environment_and_a_file(services, tmp_path):
    engine, tokenizer = services
    key_file = tmp_path / "keys"
    key_file.write_text(KEYS[1] + "\n")
    process = spawn_gateway(
        engine.port,
        tokenizer.port,
        "--api-key-file",
        str(key_file),
        env={**os.environ, "FOLIO_API_KEYS": KEYS[0]},
    )
    try:
        line = process.stdout.readline()
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        url = f"http://127.0.0.1:{match[1]}"
        check_error(httpx.get(url + "/v1/models", timeout=TIMEOUT), 401, None)
        for key in KEYS:
            response = httpx.get(
                url + "/v1/models", timeout=TIMEOUT, headers={"Authorization": f"Bearer {key}"}
            )
            assert response.status_code == 200, response.text
        command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert not any(key.encode() in command_line for key in KEYS)
    finally:
        process.terminate()
        output, errors = process.communicate(timeout=60)
    assert not any(key in output + errors for key in (*KEYS, WRONG)), output + errors


def test_keys_are_never_logged(services, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    server = start_gateway(services, api_keys=KEYS)
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            for key in (WRONG, KEYS[0]):
                http.post(
                    "/v1/completions",
                    json={"prompt": "Hi", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {key}"},
                )
                http.post(
                    "/v1/completions",
                    json={"prompt": "Hi", "max_tokens": 10**6},
                    headers={"Authorization": f"Bearer {key}"},
                )  # a 400 too
        stub = gateway_pb2_grpc.GatewayServiceStub(server.grpc_channel)
        for key in (WRONG, KEYS[1]):
            with contextlib.suppress(grpc.RpcError):
                list(
                    stub.Generate(
                        gateway_pb2.GatewayServiceGenerateRequest(
                            prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=2)
                        ),
                        metadata=bearer(key),
                        timeout=TIMEOUT,
                    )
                )
    finally:
        server.close()
    # The clients' own debug logs (httpx, httpcore) are not the gateway's.
    records = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    captured = capfd.readouterr()
    text = (
        "\n".join(r.getMessage() + str(r.exc_info) for r in records) + captured.out + captured.err
    )
    for key in (*KEYS, WRONG):
        assert key not in text


@pytest.mark.parametrize(
    ("origins", "problem"),
    [
        (("*", "http://localhost:3000", "https://app.example.com"), None),
        (('["*"]',), "vLLM's JSON list"),
        (("https://app.example.com/",), "got 'https://app.example.com/'"),
        (("app.example.com",), "origins like"),
    ],
)
def test_an_allowed_origin_is_one_a_browser_sends(origins, problem):
    if problem is None:
        assert GatewayConfig(allowed_origins=origins).allowed_origins == origins
        return
    with pytest.raises(ValueError, match=problem):
        GatewayConfig(allowed_origins=origins)


def test_browsers_on_allowed_origins_may_call_the_api(keyed, services):
    """CORS: none by default; with --allowed-origins a preflight from an allowed origin is
    answered before any key is asked for, and every answer to it (an error too) names it."""
    origin, other = "https://app.example.com", "https://evil.example.net"

    def preflight(http: httpx.Client, from_origin: str) -> httpx.Response:
        return http.options(
            "/v1/chat/completions",
            headers={
                "origin": from_origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )

    with httpx.Client(base_url=keyed.url, timeout=TIMEOUT) as http:
        assert "access-control-allow-origin" not in preflight(http, origin).headers
        answer = http.get("/v1/models", headers={"origin": origin, **dict(bearer(KEYS[0]))})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    server = start_gateway(services, api_keys=KEYS, allowed_origins=(origin,))
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            allowed = preflight(http, origin)
            assert allowed.status_code == 200, allowed.text
            assert allowed.headers["access-control-allow-origin"] == origin
            assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
            refused = preflight(http, other)
            assert refused.status_code == 400
            assert "access-control-allow-origin" not in refused.headers
            for key, status in ((KEYS[0], 200), (WRONG, 401)):
                answer = http.get("/v1/models", headers={"origin": origin, **dict(bearer(key))})
                assert answer.status_code == status
                assert answer.headers["access-control-allow-origin"] == origin
    finally:
        server.close()
