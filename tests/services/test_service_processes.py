"""`folio tokenizer` and `folio engine` as real processes: they print their address, turn
SERVING once loaded, and on SIGTERM drain and exit 0."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tokenizer.server import TokenizerService
from tiny_models import VARIANTS, make_checkpoint


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint(directory, *VARIANTS["llama"])
    return directory


def run_until_serving_then_stop(args: list[str], service_name: str) -> None:
    command = [sys.executable, "-m", "folio.cli", *args, "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, f"unexpected first line {line!r}"
        with grpc.insecure_channel(f"127.0.0.1:{match[1]}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            status = None
            while status != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
                status = health.Check(
                    health_pb2.HealthCheckRequest(service=service_name), timeout=10
                ).status
                time.sleep(0.05)
            assert status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_folio_tokenizer_process(default_model_dir):
    run_until_serving_then_stop(
        ["tokenizer", "--model", str(default_model_dir)], TokenizerService.service_names[0]
    )


def test_folio_engine_process(tiny_model_dir):
    run_until_serving_then_stop(
        ["engine", "--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64"],
        "folio.v1.EngineService",
    )


def test_folio_engine_stopped_while_loading_exits_cleanly(default_model_dir):
    """SIGTERM while the model is still loading waits for the load, then exits 0 (the engine
    loads in its own thread; the process must not die with that thread midway)."""
    command = [
        sys.executable,
        "-m",
        "folio.cli",
        "engine",
        "--model",
        str(default_model_dir),
        "--port",
        "0",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert "listening on" in line, line
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
        stderr = process.stderr.read()
        assert code == 0, stderr
        assert "terminate called" not in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
