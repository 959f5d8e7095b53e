"""Faults under a real `folio serve` with the default model: a service killed (SIGKILL) while
requests are in flight, a service that keeps dying, and a SIGTERM drain.

A killed engine must end every request in flight at once with a clear error (503 or an SSE error
event over HTTP, UNAVAILABLE over the gateway's gRPC API; never a hung connection); requests in
flight when the tokenizer dies go on (the gateway makes their text itself). /health must say 503
while either is down, the supervisor restarts it and service resumes with no manual step. One
server takes the kills (module fixture); the drain test and the long run (FOLIO_LONG_TESTS=1)
start their own.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, gateway_pb2_grpc
from common.grpc_stubs.folio.v1 import gateway_pb2 as gateway_pb
from serve_process import ENGINE_ARGS, ServeProcess, alive, start_serve

LONG = os.environ.get("FOLIO_LONG_TESTS") == "1"
# No request may take longer than this: a hung connection fails the test instead of hanging it.
CLIENT_TIMEOUT = 60.0
# After a kill, every request in flight must have ended within this (the machine is loaded).
END_SECONDS = 15.0
# A restarted engine imports torch and loads the model again, next to the other two processes.
RECOVERY_SECONDS = 180.0
# Each kill test kills a service once; the crash-loop test kills the gateway one time more.
MAX_RESTARTS = 3
# Room for the drained request's tokens on a machine loaded by other test runs.
DRAIN_SECONDS = 120.0
PROMPT = "Count from one to one thousand:"
# Enough tokens that no request ends by itself before the kill, even on compiled decode
# programs loaded at start (400 ended in ~6 s there, at times before all eight were seen in
# flight); eight of them still fit the test servers' 512 blocks of 16 tokens.
LONG_MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory) -> ServeProcess:
    server = start_serve(
        tmp_path_factory.mktemp("faults") / "serve.log",
        *ENGINE_ARGS,
        "--max-restarts",
        str(MAX_RESTARTS),
    )
    yield server
    server.stop()


@dataclass
class Flight:
    """One HTTP completion running in a thread of its own, and how it ended."""

    stream: bool
    status: int | None = None
    events: list[str] = field(default_factory=list)  # SSE data payloads in order
    body: bytes = b""
    transport_error: httpx.HTTPError | None = None  # the connection broke or timed out
    first_event: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    leave: threading.Event = field(default_factory=threading.Event)  # set: the client leaves

    def error(self) -> dict:
        """The OpenAI error the request ended with (the body, or the SSE error event)."""
        assert self.transport_error is None, repr(self.transport_error)
        if self.stream and self.status == 200:
            assert self.events[-1] == "[DONE]", self.events[-3:]
            return json.loads(self.events[-2])["error"]
        assert self.status == 503, (self.status, self.body)
        return json.loads(self.body)["error"]


def fly(url: str, stream: bool, max_tokens: int = LONG_MAX_TOKENS) -> Flight:
    flight = Flight(stream)
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }

    def run() -> None:
        try:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT
            ) as response:
                flight.status = response.status_code
                if stream and response.status_code == 200:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            flight.events.append(line.removeprefix("data: "))
                            flight.first_event.set()
                        if flight.leave.is_set():
                            break  # closing the response aborts the request
                else:
                    flight.body = response.read()
        except httpx.HTTPError as exc:
            flight.transport_error = exc
        finally:
            flight.ended.set()

    threading.Thread(target=run, daemon=True).start()
    return flight


def engine_load(server: ServeProcess) -> int:
    """Requests the engine holds, running or waiting (as the gateway's /metrics shows them:
    only the gateway may call the engine)."""
    metrics = httpx.get(f"{server.url}/metrics", timeout=CLIENT_TIMEOUT).text
    return sum(
        int(float(value))
        for _kind, value in re.findall(
            r"^folio_num_requests_(running|waiting) (\S+)$", metrics, re.MULTILINE
        )
    )


def health(server: ServeProcess) -> int:
    try:
        return httpx.get(f"{server.url}/health", timeout=CLIENT_TIMEOUT).status_code
    except httpx.TransportError:
        return 0  # the gateway itself is not listening (it is being restarted)


class HealthWatch:
    """/health polled in a thread of its own, so that a short 503 is not missed."""

    def __init__(self, server: ServeProcess) -> None:
        self.seen: list[int] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(server,), daemon=True)
        self._thread.start()

    def _poll(self, server: ServeProcess) -> None:
        while not self._stopped.wait(0.05):
            self.seen.append(health(server))

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(CLIENT_TIMEOUT)


def wait_health(server: ServeProcess, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (seen := health(server)) != status:
        assert time.monotonic() < deadline, (
            f"/health still {seen}, not {status}:\n{server.output()}"
        )
        time.sleep(0.05)


def models(server: ServeProcess) -> list[dict]:
    response = httpx.get(f"{server.url}/v1/models", timeout=CLIENT_TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()["data"]


Kill = Callable[[Callable[[], None]], None]


def kill_and_recover(server: ServeProcess, role: str, kill: Kill) -> None:
    """`kill` sets up traffic, SIGKILLs the `role` process with the function it is given and
    checks the traffic; then /health turns 503, the supervisor restarts the process and the
    service answers again with the same model."""
    served = models(server)
    pid = server.child_pid(role)
    since = len(server.output())
    watch = HealthWatch(server)
    try:
        kill(lambda: os.kill(pid, signal.SIGKILL))
        deadline = time.monotonic() + END_SECONDS
        while 503 not in watch.seen:
            assert time.monotonic() < deadline, f"/health did not turn 503: {watch.seen}"
            time.sleep(0.05)
    finally:
        watch.stop()
    server.wait_for_output(
        rf"folio: {role} was killed by SIGKILL while serving \(pid {pid}\); restarting it in "
        rf"[\d.]+ s",
        END_SECONDS,
        since,
    )
    wait_health(server, 200, RECOVERY_SECONDS)
    restarted = int(server.wait_for_output(rf"restarted {role} \(pid (\d+)\)", 1, since)[1])
    assert server.child_pid(role) == restarted != pid
    server.wait_for_output(
        rf"folio: {role} is serving again, \d+\.\d s after its restart", RECOVERY_SECONDS, since
    )
    assert models(server) == served  # the gateway checked the model again: still the same
    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=CLIENT_TIMEOUT,
        json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")


def kill_during_traffic(server: ServeProcess, role: str, per_kind: int) -> None:
    """Completions in flight when `role` is killed. The engine's, `per_kind` streamed and
    `per_kind` whole, each end promptly with a 503 or an SSE error event naming it. The
    tokenizer's, `per_kind` streams, go on (the gateway turns tokens into text itself): each
    gets more text after the kill, with no error, until its client leaves."""
    flights: list[Flight] = []
    engine = role == "engine"

    def kill(now: Callable[[], None]) -> None:
        kinds = (True, False) if engine else (True,)
        flights.extend(fly(server.url, stream) for stream in kinds for _ in range(per_kind))
        deadline = time.monotonic() + CLIENT_TIMEOUT
        # Streams have their first token and the engine holds every request: all in flight.
        while not (
            all(f.first_event.is_set() for f in flights if f.stream)
            and engine_load(server) == len(flights)
        ):
            ended = [
                (f.stream, f.status, f.body[-300:], f.events[-1:])
                for f in flights
                if f.ended.is_set()
            ]
            assert not ended, f"requests ended before the kill: {ended}, load {engine_load(server)}"
            assert time.monotonic() < deadline, "the requests did not all start"
            time.sleep(0.05)
        if LONG:
            time.sleep(random.uniform(0, 2))  # anywhere in the generation, not just its start
        now()
        killed_at = time.monotonic()
        if not engine:
            at_kill = [len(f.events) for f in flights]
            while not all(len(f.events) > n + 1 for f, n in zip(flights, at_kill, strict=True)):
                assert not any(f.ended.is_set() for f in flights), [f.events[-2:] for f in flights]
                assert time.monotonic() < killed_at + CLIENT_TIMEOUT, "streams stopped"
                time.sleep(0.05)
            for flight in flights:
                flight.leave.set()
        for flight in flights:
            ends_by = killed_at + (END_SECONDS if engine else 2 * CLIENT_TIMEOUT)
            assert flight.ended.wait(max(ends_by - time.monotonic(), 0)), (
                f"a {'streamed' if flight.stream else 'whole'} request hung after the kill"
            )
        for flight in flights:
            if engine:
                error = flight.error()
                assert error["type"] == "service_unavailable" and role in error["message"], error
            else:
                assert flight.transport_error is None and flight.status == 200
                assert not any('"error"' in event for event in flight.events), flight.events[-2:]

    kill_and_recover(server, role, kill)


@pytest.mark.parametrize("role", ["engine", "tokenizer"])
def test_killing_a_service_under_traffic_then_it_is_restarted(server, role):
    kill_during_traffic(server, role, per_kind=4)


def test_grpc_stream_in_flight_gets_unavailable_when_the_engine_dies(server):
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        def request(max_tokens: int) -> gateway_pb.GatewayServiceGenerateRequest:
            return gateway_pb.GatewayServiceGenerateRequest(
                prompt=PROMPT,
                sampling_params=common_pb2.SamplingParams(
                    max_tokens=max_tokens, ignore_eos=True, temperature=0
                ),
            )

        def kill(now: Callable[[], None]) -> None:
            responses = stub.Generate(request(LONG_MAX_TOKENS), timeout=CLIENT_TIMEOUT)
            next(responses)  # generating
            now()
            killed_at = time.monotonic()
            with pytest.raises(grpc.RpcError) as ended:
                for _ in responses:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
            assert "engine" in ended.value.details()
            assert time.monotonic() - killed_at < END_SECONDS

        kill_and_recover(server, "engine", kill)
        # The same channel serves again: the gateway opened a new stream to the new engine.
        last = list(stub.Generate(request(8), timeout=CLIENT_TIMEOUT))[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 8


def test_a_gateway_that_keeps_dying_ends_serve_with_an_error(server):
    """Last of the module: it ends the shared server. The gateway, restarted once, serves
    again; killed more than --max-restarts times in a row, folio serve gives up."""
    pid = server.child_pid("gateway")
    for death in range(1, MAX_RESTARTS + 2):
        since = len(server.output())
        os.kill(pid, signal.SIGKILL)
        if death == MAX_RESTARTS + 1:
            break
        pid = int(
            server.wait_for_output(r"restarted gateway \(pid (\d+)\)", RECOVERY_SECONDS, since)[1]
        )
        if death == 1:
            wait_health(server, 200, RECOVERY_SECONDS)  # a new gateway, reconnected to both
    children = server.children()
    assert server.process.wait(CLIENT_TIMEOUT) == 1
    output = server.output()
    assert (
        f"folio: error: gateway was killed by SIGKILL while serving (pid {pid}): it died "
        f"{MAX_RESTARTS + 1} times in a row, more than --max-restarts {MAX_RESTARTS} "
        f"allows; giving up"
    ) in output, output
    assert not [p for p in children if alive(p)], "orphaned service processes"


def test_sigterm_drains_then_every_process_exits_0(default_model_dir, tmp_path):
    server = start_serve(
        tmp_path / "serve.log", *ENGINE_ARGS, "--drain-seconds", str(DRAIN_SECONDS)
    )
    try:
        children = server.children()
        in_flight = fly(server.url, stream=True, max_tokens=64)
        assert in_flight.first_event.wait(CLIENT_TIMEOUT)
        server.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        # Until the gateway hears of it, a new request may still be taken (and finish: it is
        # one token); from then on it is refused.
        while (
            refused := httpx.post(
                f"{server.url}/v1/completions",
                timeout=CLIENT_TIMEOUT,
                json={"prompt": "Hi", "max_tokens": 1},
            )
        ).status_code != 503:
            assert refused.status_code == 200, refused.text
            assert time.monotonic() - signalled_at < END_SECONDS, "SIGTERM did not start a drain"
        assert "draining" in refused.json()["error"]["message"]
        with grpc.insecure_channel(server.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as grpc_refused:
                list(
                    gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
                        gateway_pb.GatewayServiceGenerateRequest(
                            prompt="Hi", sampling_params=common_pb2.SamplingParams(max_tokens=1)
                        ),
                        timeout=CLIENT_TIMEOUT,
                    )
                )
            assert grpc_refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert in_flight.ended.wait(DRAIN_SECONDS), (len(in_flight.events), server.output())
        assert in_flight.status == 200 and in_flight.events[-1] == "[DONE]", in_flight.events[-3:]
        assert json.loads(in_flight.events[-2])["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(DRAIN_SECONDS) == 0, server.output()
        output = server.output()
        for role in ("gateway", "engine", "tokenizer"):
            assert f"folio: {role} exited with code 0 while stopping" in output, output
        assert not [pid for pid in children if alive(pid)], "orphaned service processes"
    finally:
        server.kill()


@pytest.mark.skipif(not LONG, reason="long run: set FOLIO_LONG_TESTS=1")
def test_many_kills_under_load(default_model_dir, tmp_path):
    server = start_serve(tmp_path / "serve.log", *ENGINE_ARGS, "--max-restarts", "100")
    try:
        for role in ["engine", "tokenizer"] * 4:
            kill_during_traffic(server, role, per_kind=12)
        assert server.stop() == 0
    finally:
        server.kill()
