"""Test helper for the gateway tests: the engine settings they share and a GatewayServer run
on an event loop of its own, so tests can use blocking clients."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import time

import grpc
import httpx
from common.grpc_stubs.folio.v1 import engine_pb2, engine_pb2_grpc

from common.config import GatewayConfig
from gateway.front.server import GatewayServer
from grpc_helpers import TIMEOUT, LoopThread

# Prefix caching off: a prompt computed partly from cached blocks rounds differently in bf16,
# and the tests compare runs of the same prompt token for token. dtype auto: bf16 where the CPU
# computes it natively; emulated on an AVX2-only CPU it made each step several times slower.
MAX_MODEL_LEN = 1024
ENGINE_ARGS = dict(
    dtype="auto",
    num_kv_blocks=512,
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=16,
    enable_prefix_caching=False,
)


class GatewayThread(LoopThread):
    """A GatewayServer on an event loop of its own, so tests use blocking clients."""

    def __init__(
        self,
        engine_address: str | list[str],
        tokenizer_address: str,
        config: GatewayConfig | None = None,
        internal_token: str | None = None,
    ) -> None:
        super().__init__()
        config = config or GatewayConfig()
        # Batch jobs in a directory of this gateway's own, not the user's Folio cache.
        self._batch_dir = None
        if config.batch_dir is None:
            self._batch_dir = tempfile.TemporaryDirectory(prefix="folio-batches-")
            config = dataclasses.replace(config, batch_dir=self._batch_dir.name)
        self.server = GatewayServer(
            "127.0.0.1",
            0,
            0,
            engine_address,
            tokenizer_address,
            config=config,
            internal_token=internal_token,
        )
        self.call(self.server.start())
        self.url = f"{config.scheme}://127.0.0.1:{self.server.port}"
        grpc_address = f"127.0.0.1:{self.server.grpc_port}"
        if config.ssl_certfile is None:
            self.grpc_channel = grpc.insecure_channel(grpc_address)
        else:  # a certificate of its own, trusted as its own authority
            with open(config.ssl_certfile, "rb") as chain:
                credentials = grpc.ssl_channel_credentials(root_certificates=chain.read())
            self.grpc_channel = grpc.secure_channel(grpc_address, credentials)

    def close(self) -> None:
        self.grpc_channel.close()
        self.call(self.server.stop(grace=1))
        self.stop_loop()
        if self._batch_dir is not None:
            self._batch_dir.cleanup()


def start_gateway(services, **config) -> GatewayThread:
    """A GatewayThread before the (engine, tokenizer) services, with GatewayConfig(**config)."""
    engine, tokenizer = services
    return GatewayThread(
        f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}", GatewayConfig(**config)
    )


def gateway_command(engine_address: str, tokenizer_address: str, *args: str) -> list[str]:
    """`folio gateway` on free ports in front of the given services, with `args` added."""
    return [
        sys.executable,
        "-m",
        "folio.cli",
        "gateway",
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--engine-address",
        engine_address,
        "--tokenizer-address",
        tokenizer_address,
        *args,
    ]


def spawn_gateway(
    engine_port: int, tokenizer_port: int, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`folio gateway` as a process of its own on free ports, in front of the given services,
    with `args` added; text pipes, and its first line says where it listens."""
    return subprocess.Popen(
        gateway_command(f"127.0.0.1:{engine_port}", f"127.0.0.1:{tokenizer_port}", *args),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def engine_stats(stub: engine_pb2_grpc.EngineServiceStub) -> engine_pb2.GetStatsResponse:
    return stub.GetStats(engine_pb2.GetStatsRequest(), timeout=TIMEOUT)


def wait_engine_idle(stub: engine_pb2_grpc.EngineServiceStub, seconds: float = 5.0) -> None:
    """Return once the engine runs and queues nothing; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while (stats := engine_stats(stub)).num_running or stats.num_waiting:
        assert time.monotonic() < deadline, f"the engine still has requests: {stats}"
        time.sleep(0.02)


def read_metrics(url: str) -> dict[str, float]:
    """The gateway's /metrics samples, keyed by name with their labels as written."""
    samples = {}
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_for_idle_engine(url: str, idle_kv_usage: float, seconds: float) -> dict[str, float]:
    """Poll /metrics until the engine runs nothing, queues nothing and its KV cache is back at
    `idle_kv_usage`; fail with the last samples after `seconds`. Returns them."""
    deadline = time.monotonic() + seconds
    while True:
        samples = read_metrics(url)
        if (
            samples["folio_num_requests_running"] == 0
            and samples["folio_num_requests_waiting"] == 0
            and samples["folio_kv_cache_usage_ratio"] == idle_kv_usage
        ):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the engine is not idle {seconds} s later: "
                f"{samples['folio_num_requests_running']:.0f} running, "
                f"{samples['folio_num_requests_waiting']:.0f} waiting, KV cache usage "
                f"{samples['folio_kv_cache_usage_ratio']} (idle: {idle_kv_usage})"
            )
        time.sleep(0.05)


def check_error(response: httpx.Response, status: int, param: str | None) -> dict:
    """The response is `status` with the OpenAI error body, naming `param` (in the message
    too); returns the error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]
    return error
