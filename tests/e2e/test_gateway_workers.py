"""Several gateway processes per engine: `folio serve --gateway-workers 2` and `folio gateway
--workers 2` on a tiny random-weight model with SmolLM2's tokenizer. Requests are served by both
workers (each HTTP response names its worker, x-folio-gateway-worker), every worker's /metrics
shows the same sums over both, a per-key rate limit is the whole server's, a worker that dies is
restarted, and SIGTERM drains the streams in flight on every worker."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ServeProcess, alive, start_serve

from common.config import API_KEYS_ENV, INTERNAL_TOKEN_ENV
from gateway.front.server import WORKER_HEADER
from gateway.front.workers import METRICS_DIR_ENV
from gateway_helpers import gateway_command
from tiny_models import make_tiny_smollm2

TIMEOUT = 60
WORKERS = {"0", "1"}
# One request per key per 100 s: a second one is refused however slow the machine.
SLOW_RPS = "0.01"
KEYS = ("sk-workers-a", "sk-workers-b", "sk-workers-c")
# Streams last about this long, whatever the machine's speed: still running when SIGTERM comes.
STREAM_SECONDS = 2.0
LISTENING = re.compile(r"gateway listening on (http://\S+) \(gRPC (\S+)\)")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    return make_tiny_smollm2(tmp_path_factory.mktemp("tiny-workers"), default_model_dir)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> ServeProcess:
    server = start_serve(
        tmp_path_factory.mktemp("workers") / "serve.log",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "1024",
        "--gateway-workers",
        "2",
    )
    yield server
    assert server.stop() == 0, server.output()


@dataclass
class GatewayProcess:
    process: subprocess.Popen
    log: Path
    url: str = ""
    grpc_address: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_output(self, pattern: str, since: int = 0) -> re.Match:
        deadline = time.monotonic() + TIMEOUT
        while not (match := re.compile(pattern).search(self.output(), since)):
            assert self.process.poll() is None or "stopping" in pattern, self.output()
            assert time.monotonic() < deadline, f"no {pattern!r}:\n{self.output()}"
            time.sleep(0.05)
        return match

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def spawn_workers(stack: ServeProcess, log: Path, *args: str) -> GatewayProcess:
    """`folio gateway --workers 2` in front of the stack's engine and tokenizer."""
    with log.open("w") as out:
        process = subprocess.Popen(
            gateway_command(stack.engine_address, stack.tokenizer_address, "--workers", "2", *args),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={
                **os.environ,
                INTERNAL_TOKEN_ENV: stack.internal_token,
                API_KEYS_ENV: ",".join(KEYS),
            },
        )
    gateway = GatewayProcess(process, log)
    try:
        gateway.url, gateway.grpc_address = gateway.wait_for_output(LISTENING.pattern).groups()
    except BaseException:
        gateway.close()
        raise
    return gateway


@pytest.fixture(scope="module")
def limited_gateway(stack, tmp_path_factory):
    gateway = spawn_workers(
        stack, tmp_path_factory.mktemp("limited") / "gateway.log", "--rate-limit-rps", SLOW_RPS
    )
    yield gateway
    gateway.close()


def environment(pid: int) -> dict[str, str]:
    """A process's environment, as it started."""
    variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(v.decode().split("=", 1) for v in variables if b"=" in v)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def fresh(method: str, url: str, **kwargs) -> httpx.Response:
    """One request on a connection of its own: the kernel hands it to either worker."""
    with httpx.Client(timeout=TIMEOUT) as client:
        return client.request(method, url, **kwargs)


@contextlib.contextmanager
def client_on_each_worker(
    url: str, headers: dict[str, str] | None = None, most: int = 500
) -> Iterator[dict[str, httpx.Client]]:
    """A client per worker, by its index: a kept-alive connection stays with the worker that
    accepted it, so new connections are opened until each worker holds one."""
    clients: dict[str, httpx.Client] = {}
    try:
        for _ in range(most):
            client = httpx.Client(base_url=url, timeout=TIMEOUT, headers=headers)
            worker = client.get("/health").headers[WORKER_HEADER]
            if worker in clients:
                client.close()
            else:
                clients[worker] = client
            if set(clients) == WORKERS:
                break
        assert set(clients) == WORKERS, f"{most} connections all went to {set(clients)}"
        yield clients
    finally:
        for client in clients.values():
            client.close()


def scrape(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    """The /metrics samples of the client's worker by (name, labels); each series once."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, f"{key} twice in one scrape"
            samples[key] = sample.value
    return samples


GATEWAY_SERIES = (
    ("folio_requests_total", (("finish_reason", "length"),)),
    ("folio_generation_tokens_total", ()),
    ("folio_prompt_tokens_total", ()),
    ("folio_e2e_request_latency_seconds_count", ()),
    ("folio_time_to_first_token_seconds_count", ()),
)


def gateway_counts(samples: dict) -> dict[str, float]:
    """The gateway's own request counts, and the requests it routed to its engine replicas."""
    counts = {name: samples.get((name, labels), 0.0) for name, labels in GATEWAY_SERIES}
    counts["folio_replica_requests_routed_total"] = sum(
        value
        for (name, _), value in samples.items()
        if name == "folio_replica_requests_routed_total"
    )
    return counts


def replica_series(samples: dict) -> dict[tuple[str, tuple], float]:
    """The per-replica series that are not the engines' live load."""
    return {
        key: value
        for key, value in samples.items()
        if key[0] in ("folio_replica_healthy", "folio_replica_indexed_blocks")
    }


def test_both_workers_serve_and_every_scrape_shows_their_sums(stack):
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    with client_on_each_worker(stack.url) as clients:
        before = {worker: gateway_counts(scrape(c)) for worker, c in clients.items()}
        assert before["0"] == before["1"]
        # Each worker serves requests of its own: 2 on worker 0, 3 on worker 1.
        responses = [clients[worker].post("/v1/completions", json=body) for worker in "01011"]
        assert [r.headers[WORKER_HEADER] for r in responses] == list("01011")
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        # The gRPC text API shares its port between the workers too.
        with grpc.insecure_channel(stack.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GatewayServiceGenerateRequest(
                prompt="Hello",
                sampling_params=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
            )
            grpc_usage = list(stub.Generate(request, timeout=TIMEOUT))[-1].usage
        sent = len(responses) + 1
        completion = sum(r.json()["usage"]["completion_tokens"] for r in responses)
        prompt = sum(r.json()["usage"]["prompt_tokens"] for r in responses)
        expected_delta = {
            "folio_requests_total": sent,
            "folio_generation_tokens_total": completion + grpc_usage.completion_tokens,
            "folio_prompt_tokens_total": prompt + grpc_usage.prompt_tokens,
            "folio_e2e_request_latency_seconds_count": sent,
            "folio_time_to_first_token_seconds_count": sent,
            "folio_replica_requests_routed_total": sent,
        }
        # Whichever worker answers the scrape, it shows both workers' sums; the engine's own
        # series come from GetStats, once.
        replicas = {}
        for worker, client in clients.items():
            samples = scrape(client)
            counts = gateway_counts(samples)
            assert {k: counts[k] - before[worker][k] for k in counts} == expected_delta, worker
            assert samples[("folio_num_kv_blocks", ())] == 1024
            replicas[worker] = replica_series(samples)
        assert replicas["0"] == replicas["1"] and replicas["0"], replicas


def test_a_key_rate_limit_is_the_whole_servers(limited_gateway):
    with client_on_each_worker(limited_gateway.url) as clients:
        # A bucket per worker would admit the key once on each; together they admit it once.
        assert clients["0"].get("/v1/models", headers=auth(KEYS[0])).status_code == 200
        refused = clients["1"].get("/v1/models", headers=auth(KEYS[0]))
        assert refused.status_code == 429, refused.text
        assert "requests per second" in refused.json()["error"]["message"]
        # The gRPC API charges the same bucket, whichever worker takes the call.
        with grpc.insecure_channel(limited_gateway.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GatewayServiceGenerateRequest(
                prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=1)
            )
            metadata = (("authorization", f"Bearer {KEYS[0]}"),)
            with pytest.raises(grpc.RpcError) as failure:
                list(stub.Generate(request, metadata=metadata, timeout=TIMEOUT))
            assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Another key has its own bucket, on either worker.
        assert clients["1"].get("/v1/models", headers=auth(KEYS[1])).status_code == 200
        assert clients["0"].get("/v1/models", headers=auth(KEYS[1])).status_code == 429


def test_a_worker_that_dies_is_restarted(limited_gateway):
    pids = [
        int(p)
        for p in limited_gateway.wait_for_output(r"gateway workers, pids (\d+) (\d+)").groups()
    ]
    # Each worker's view of the replicas (health, indexed blocks) is a live gauge's file.
    metrics_dir = Path(environment(pids[0])[METRICS_DIR_ENV])
    assert list(metrics_dir.glob(f"gauge_live*_{pids[1]}.db"))
    since = len(limited_gateway.output())
    os.kill(pids[1], signal.SIGKILL)
    restarted = limited_gateway.wait_for_output(r"restarted gateway worker 1 \(pid (\d+)\)", since)
    assert f"gateway worker 1 (pid {pids[1]}) was killed by SIGKILL while serving" in (
        limited_gateway.output()
    )
    # A dead worker's view leaves /metrics with it (its counters stay in the sums).
    assert not list(metrics_dir.glob(f"gauge_live*_{pids[1]}.db"))
    assert int(restarted[1]) not in pids and alive(int(restarted[1]))
    # The new worker serves (once it is up: until then the other takes every connection).
    deadline = time.monotonic() + TIMEOUT
    while fresh("GET", limited_gateway.url + "/health").headers[WORKER_HEADER] != "1":
        assert time.monotonic() < deadline, limited_gateway.output()
        time.sleep(0.02)
    assert limited_gateway.process.poll() is None


@dataclass
class Stream:
    """A streamed completion on `client`'s connection, read in a thread."""

    client: httpx.Client
    max_tokens: int
    worker: str | None = None
    started: threading.Event = field(default_factory=threading.Event)
    events: list[str] = field(default_factory=list)
    ended: bool = False
    seconds: float = 0.0
    error: BaseException | None = None

    def run(self) -> None:
        body = {
            "prompt": "Count:",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.monotonic()
        try:
            with self.client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, response.read()
                self.worker = response.headers[WORKER_HEADER]
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.started.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.seconds = time.monotonic() - start
            self.ended = True
            self.started.set()

    def check_whole(self) -> None:
        assert self.ended and self.error is None, self.error
        assert self.events[-1] == "[DONE]", self.events[-3:]
        usage = json.loads(self.events[-2])["usage"]
        assert usage["completion_tokens"] == self.max_tokens, (self.worker, usage)


def stream_length(client: httpx.Client) -> int:
    """Tokens a stream needs to last about STREAM_SECONDS on this machine now."""
    probe = Stream(client, 16)
    probe.run()
    probe.check_whole()
    return max(32, min(3000, int(STREAM_SECONDS * 16 / probe.seconds)))


def test_sigterm_drains_the_streams_of_every_worker(stack, tmp_path):
    gateway = spawn_workers(stack, tmp_path / "gateway.log", "--drain-seconds", "120")
    try:
        with (
            client_on_each_worker(gateway.url, auth(KEYS[2])) as streaming,
            client_on_each_worker(gateway.url, auth(KEYS[2])) as probing,
        ):
            max_tokens = stream_length(streaming["0"])
            streams = [Stream(streaming[worker], max_tokens) for worker in sorted(WORKERS)]
            for stream in streams:
                threading.Thread(target=stream.run, daemon=True).start()
            for stream in streams:
                assert stream.started.wait(TIMEOUT) and stream.error is None, stream.error
            assert [s.worker for s in streams] == sorted(WORKERS)
            assert not any(s.ended for s in streams), "a stream ended before SIGTERM"
            gateway.process.send_signal(signal.SIGTERM)
            # Each worker drains: it refuses new work (503) once it has the signal.
            for worker, client in probing.items():
                deadline = time.monotonic() + TIMEOUT
                while (
                    status := client.post(
                        "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}
                    ).status_code
                ) != 503:
                    assert status == 200 and time.monotonic() < deadline, (worker, status)
                    time.sleep(0.02)
            # The streams go on to their end; then every worker exits, and the parent.
            assert gateway.process.wait(TIMEOUT * 3) == 0, gateway.output()
            for stream in streams:
                stream.check_whole()
        assert "while serving" not in gateway.output()  # no worker died on the way
    finally:
        gateway.close()
