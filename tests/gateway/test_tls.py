"""--ssl-keyfile / --ssl-certfile: the gateway serves its HTTP API and its gRPC text API over
TLS with the given key and certificate (made here with openssl, for 127.0.0.1), plaintext
clients get nowhere on either port, a group of gateway workers serves it too, `folio serve`'s
health probe reaches an https gateway, and the flags are checked before anything listens."""

from __future__ import annotations

import re
import ssl
import subprocess
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import GatewayConfig
from gateway_helpers import spawn_gateway, start_gateway
from grpc_helpers import TIMEOUT
from services.supervisor import _http_ok


@pytest.fixture(scope="module")
def key_and_certificate(tmp_path_factory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    key, certificate = directory / "key.pem", directory / "cert.pem"
    command = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    command += ["-keyout", str(key), "-out", str(certificate), "-subj", "/CN=localhost"]
    command += ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
    subprocess.run(command, check=True, capture_output=True)
    return key, certificate


@pytest.fixture(scope="module")
def tls_gateway(services, key_and_certificate):
    key, certificate = key_and_certificate
    server = start_gateway(services, ssl_keyfile=str(key), ssl_certfile=str(certificate))
    yield server, certificate
    server.close()


def test_both_apis_answer_over_tls_and_only_over_tls(tls_gateway):
    server, certificate = tls_gateway
    assert server.url.startswith("https://")
    trusting = ssl.create_default_context(cafile=str(certificate))
    with httpx.Client(verify=trusting, timeout=TIMEOUT) as http:
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, http_client=http
        )
        model = client.models.list().data[0].id
        greedy = {"model": model, "prompt": "Hi", "max_tokens": 3, "temperature": 0.0}
        reply = client.completions.create(**greedy)
        assert reply.usage.completion_tokens >= 1
        chunks = client.completions.create(**greedy, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    # A client that does not trust the certificate refuses it; a plaintext one is not answered.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/health", timeout=TIMEOUT)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=TIMEOUT)
    # The gRPC text API over the same certificate (GatewayThread trusts it), not without it.
    generate = gateway_pb2.GatewayServiceGenerateRequest(
        prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=2)
    )
    stub = gateway_pb2_grpc.GatewayServiceStub(server.grpc_channel)
    assert list(stub.Generate(generate, timeout=TIMEOUT))
    plaintext = grpc.insecure_channel(f"127.0.0.1:{server.server.grpc_port}")
    with plaintext, pytest.raises(grpc.RpcError) as failure:
        health_pb2_grpc.HealthStub(plaintext).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT
        )
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


def test_folio_serves_health_probe_reaches_an_https_gateway(tls_gateway):
    server, _ = tls_gateway
    assert _http_ok(server.url + "/health", {})()
    assert not _http_ok(server.url.replace("https://", "http://") + "/health", {})()


def test_the_key_and_certificate_are_checked_before_anything_listens(key_and_certificate, tmp_path):
    key, certificate = key_and_certificate
    with pytest.raises(ValueError, match="ssl_keyfile and ssl_certfile go together"):
        GatewayConfig(ssl_keyfile=str(key))
    assert GatewayConfig(ssl_keyfile=str(key), ssl_certfile=str(certificate)).scheme == "https"
    with pytest.raises(ValueError, match=r"ssl_certfile '/no/cert\.pem' is not a file"):
        GatewayConfig(ssl_keyfile=str(key), ssl_certfile="/no/cert.pem")
    # A file that is no PEM key, a key with a passphrase (no terminal prompt), and a key that
    # is not the certificate's.
    not_a_key = tmp_path / "not-a-key.pem"
    not_a_key.write_text("not a key\n")
    other_key, encrypted = tmp_path / "other-key.pem", tmp_path / "encrypted.pem"
    command = ["openssl", "genpkey", "-algorithm", "RSA", "-out"]
    subprocess.run([*command, str(other_key)], check=True, capture_output=True)
    secret = ["-aes256", "-pass", "pass:secret"]
    subprocess.run([*command, str(encrypted), *secret], check=True, capture_output=True)
    for wrong, reason in (
        (not_a_key, "not PEM"),
        (encrypted, "a key with a passphrase"),
        (other_key, "KEY_VALUES_MISMATCH"),
    ):
        with pytest.raises(ValueError, match=f"do not load as a key .*{reason}"):
            GatewayConfig(ssl_keyfile=str(wrong), ssl_certfile=str(certificate))


def test_a_group_of_gateway_workers_serves_tls(services, key_and_certificate):
    """`folio gateway --workers 2` with the flags: each worker serves https on the shared
    socket, and the group says so."""
    engine, tokenizer = services
    key, certificate = key_and_certificate
    process = spawn_gateway(
        engine.port,
        tokenizer.port,
        "--workers",
        "2",
        "--ssl-keyfile",
        str(key),
        "--ssl-certfile",
        str(certificate),
    )
    try:
        line = process.stdout.readline()
        match = re.search(r"listening on https://127\.0\.0\.1:(\d+)", line)
        assert match, line
        trusting = ssl.create_default_context(cafile=str(certificate))
        for _ in range(4):  # connections land on either worker
            answer = httpx.get(f"https://127.0.0.1:{match[1]}/health", verify=trusting)
            assert answer.status_code == 200, answer.text
    finally:
        process.terminate()
        process.communicate(timeout=60)
