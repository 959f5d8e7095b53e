"""`folio serve`: the tokenizer, engine and gateway as three child processes on this machine.

Starts each child with the `folio` command of this same interpreter and hands it its part of the
serve config whole, as JSON (--config-json, common.flags), never rebuilt into flags to be parsed
again: the tokenizer and the engine where to listen and the EngineConfig, the gateway its front
(listening, policy; the API keys travel resolved in FOLIO_API_KEYS). Waits until all are healthy
(gRPC health SERVING for the tokenizer and the engine, HTTP /health 200 for the gateway), says how
long each took, prints the URL and watches them. SIGINT / SIGTERM stop the gateway first (it drains
its clients), then the engine and the tokenizer. A child that dies while serving is restarted with
the same command line, at once (if it died again in a row, after a back-off of 0.5 s, doubling up
to 8 s); the others are told nothing, since the gateway reconnects by itself. A child that keeps
dying (more than --max-restarts times without staying up for a minute in between), or one that
dies during start-up, stops the others and ends `folio serve` with a non-zero exit. This module
only starts, probes and stops processes: it holds no service logic and never imports torch or the
engine.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from common.auth import key_of, load_api_keys
from common.config import (
    API_KEYS_ENV,
    ENGINE_PORT,
    INTERNAL_TOKEN_ENV,
    RECONNECT_CHANNEL_OPTIONS,
    TOKENIZER_PORT,
    ApiKeySources,
    EngineConfig,
    EngineServiceConfig,
    GatewayFrontConfig,
    GatewayServerConfig,
    ListenConfig,
    TokenizerOptions,
    TokenizerServiceConfig,
)
from common.flags import CONFIG_JSON_FLAG, flag, to_json
from common.parent_death import child_env

# The engine and the tokenizer are internal: only the gateway listens beyond loopback.
INTERNAL_HOST = "127.0.0.1"
# How often start-up polls health and a running group checks its children.
POLL_SECONDS = 0.1
# After SIGTERM, how much longer than its drain time a child gets before it is killed.
KILL_MARGIN_SECONDS = 10.0
# A second stop request this long after the first kills what is left (a second Ctrl-C); sooner,
# it is the same request delivered twice (a wrapper forwarding the signal to the whole group).
FORCE_AFTER_SECONDS = 1.0
# A child that died once is started again at once (a recovery's time is its start-up's); one
# that dies again in a row after this back-off, doubled for each further death.
RESTART_DELAY_SECONDS = 0.5
MAX_RESTART_DELAY_SECONDS = 8.0
# A child healthy this long since its last start has recovered: its deaths in a row reset.
STABLE_SECONDS = 60.0


@dataclass
class ServeConfig:
    """`folio serve`: the gateway in front of the engine and the tokenizer, supervised."""

    front: GatewayFrontConfig = field(default_factory=GatewayFrontConfig)
    engine_port: int = flag(
        ENGINE_PORT, f"the engine service's port on {INTERNAL_HOST} (0 picks a free one)"
    )
    tokenizer_port: int = flag(
        TOKENIZER_PORT, f"the tokenizer service's port on {INTERNAL_HOST} (0 picks a free one)"
    )
    max_restarts: int = flag(
        5,
        "restarts of a service that dies again and again (without a minute of health in "
        "between) before folio serve gives up; 0: never restart",
    )
    startup_timeout: float = flag(600.0, "seconds to wait for all three services to be healthy")
    engine_replicas: int = flag(
        1,
        "engine processes, each with its own port (the first on --engine-port) and its share "
        "of the CPU cores or its own GPUs; the gateway routes between them (--routing-policy)",
    )
    gateway_workers: int = flag(
        1, "gateway processes sharing the HTTP and gRPC ports (folio gateway --workers)"
    )
    tokenizer_options: TokenizerOptions = field(default_factory=TokenizerOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.engine_replicas < 1:
            raise ValueError(f"engine_replicas must be >= 1, got {self.engine_replicas}")
        if self.gateway_workers < 1:
            raise ValueError(f"gateway_workers must be >= 1, got {self.gateway_workers}")


def replica_engine_config(engine: EngineConfig, replica: int, num_replicas: int) -> EngineConfig:
    """Engine replica `replica`'s share of the machine: on CPU the cores split between the
    replicas (each rank of a tensor-parallel replica its part), unless --num-threads says
    otherwise; on CUDA its own GPUs, T of them with tensor parallel size T, counted from the
    configured device (cuda or cuda:0: replica i gets cuda:i*T ... cuda:i*T+T-1)."""
    if num_replicas == 1:
        return engine
    size = engine.tensor_parallel_size
    if engine.device.startswith("cuda"):
        _, _, index = engine.device.partition(":")
        base = int(index) if index else 0
        return dataclasses.replace(engine, device=f"cuda:{base + replica * size}")
    if engine.num_threads is None:
        cores = len(os.sched_getaffinity(0))
        return dataclasses.replace(engine, num_threads=max(1, cores // (num_replicas * size)))
    return engine


def _service_args(command: str, config: object) -> list[str]:
    """The child's command line (after `folio`): its config whole, as JSON it reads back."""
    return [command, CONFIG_JSON_FLAG, to_json(config)]


def _free_port(host: str, held: list[socket.socket]) -> int:
    """A free port; its socket stays in `held` so that the next call picks another one."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    held.append(s)
    s.bind((host, 0))
    return s.getsockname()[1]


def _local(host: str) -> str:
    """An address this machine can reach a server bound to `host` on."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _grpc_serving(address: str) -> Callable[[], bool]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(address, options=RECONNECT_CHANNEL_OPTIONS)
    stub = health_pb2_grpc.HealthStub(channel)

    def probe() -> bool:
        try:
            # types-grpcio-health-checking declares HealthStub without its methods.
            status = stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(), timeout=1.0
            ).status
        except grpc.RpcError:
            return False  # not listening yet
        return status == health_pb2.HealthCheckResponse.SERVING

    return probe


def _http_ok(url: str, headers: dict[str, str]) -> Callable[[], bool]:
    # An https probe reaches its own child on loopback, whose certificate names the host
    # clients use, not 127.0.0.1: it asks for health, and trusts the answer, unverified.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE

    def probe() -> bool:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=1.0, context=context
            ) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False  # not listening yet, or 503 until the engine and tokenizer are ready

    return probe


@dataclass(eq=False)
class Child:
    """One service process: how to start it and how to tell it is healthy."""

    name: str
    args: list[str]  # after `folio`
    probe_factory: Callable[[], Callable[[], bool]]
    drain_seconds: float
    output: IO | None = None  # the child's stdout and stderr; None: this process's
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    process: subprocess.Popen | None = None
    started_at: float | None = None  # monotonic; its last start
    healthy_since: float | None = None  # monotonic; None until healthy after its last start
    deaths_in_a_row: int = 0
    restart_at: float | None = None  # monotonic; set while it is dead and waiting for a restart
    _probe: Callable[[], bool] | None = None

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.healthy_since = None
        self.restart_at = None
        # A process group of its own: a terminal's Ctrl-C reaches only the supervisor, which
        # stops the children in order.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "folio.cli", *self.args],
            stdin=subprocess.DEVNULL,
            stdout=self.output,
            stderr=self.output,
            env=child_env(self.env),  # it dies with the supervisor, even a SIGKILLed one
            process_group=0,
        )

    def healthy(self) -> bool:
        if self._probe is None:
            self._probe = self.probe_factory()
        if self._probe():
            if self.healthy_since is None:
                self.healthy_since = time.monotonic()
            return True
        return False

    def startup_seconds(self) -> float:
        """From its last start to its first healthy probe after it."""
        assert self.started_at is not None and self.healthy_since is not None
        return self.healthy_since - self.started_at

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        if self.process is not None and self.exit_code() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process is not None and self.exit_code() is None:
            self.process.kill()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def describe_exit(self) -> str:
        code = self.exit_code()
        if code is not None and code < 0:
            return f"{self.name} was killed by {signal.Signals(-code).name}"
        return f"{self.name} exited with code {code}"


class ServeError(RuntimeError):
    """`folio serve` could not start or lost a service; the message says which and why."""


class Supervisor:
    """Starts, watches and stops the tokenizer, engine and gateway processes."""

    def __init__(self, config: ServeConfig, output: IO | None = None) -> None:
        self.config = config
        listen = config.front.listen
        # Fix every port before starting anything: the gateway must know the others' addresses.
        # A port picked here is free now; its child binds it moments later (a race we accept).
        held: list[socket.socket] = []
        self.host = listen.host
        self.port = listen.port or _free_port(listen.host, held)
        self.grpc_port = config.front.grpc_port or _free_port(listen.host, held)
        # The first replica on --engine-port; the others on free ports (the next numbers up
        # may well be the tokenizer's).
        self.engine_addresses = [
            f"{INTERNAL_HOST}:{config.engine_port or _free_port(INTERNAL_HOST, held)}",
            *(
                f"{INTERNAL_HOST}:{_free_port(INTERNAL_HOST, held)}"
                for _ in range(config.engine_replicas - 1)
            ),
        ]
        self.engine_address = self.engine_addresses[0]
        self.tokenizer_address = (
            f"{INTERNAL_HOST}:{config.tokenizer_port or _free_port(INTERNAL_HOST, held)}"
        )
        for s in held:
            s.close()
        # A plain attribute, polled, not a threading.Event: a signal handler runs in the main
        # thread between two of its bytecodes, perhaps while that thread holds the Event's lock
        # inside Event.wait, and setting the Event there deadlocked `folio serve` on Ctrl-C.
        self._stop_requested_at: float | None = None
        self._force = False
        drain = listen.drain_seconds

        def internal(address: str) -> ListenConfig:
            return ListenConfig(INTERNAL_HOST, int(address.rsplit(":", 1)[1]), drain)

        self.tokenizer = Child(
            "tokenizer",
            _service_args(
                "tokenizer",
                TokenizerServiceConfig(
                    config.engine.model,
                    internal(self.tokenizer_address),
                    config.tokenizer_options,
                ),
            ),
            lambda: _grpc_serving(self.tokenizer_address),
            drain,
            output,
        )
        replicas = config.engine_replicas
        self.engines = [
            Child(
                "engine" if replicas == 1 else f"engine-{i}",
                _service_args(
                    "engine",
                    EngineServiceConfig(
                        internal(address),
                        replica_engine_config(config.engine, i, replicas),
                        generate_socket_port=0,  # free ones: replicas share the host
                    ),
                ),
                functools.partial(_grpc_serving, address),
                drain,
                output,
            )
            for i, address in enumerate(self.engine_addresses)
        ]
        self.engine = self.engines[0]
        # The gateway's keys travel resolved, in the environment (below), never in its config.
        self.api_keys = load_api_keys(config.front.keys.api_key, config.front.keys.api_key_file)
        front = dataclasses.replace(
            config.front,
            listen=dataclasses.replace(listen, port=self.port),
            grpc_port=self.grpc_port,
            keys=ApiKeySources(),
        )
        self.gateway = Child(
            "gateway",
            _service_args(
                "gateway",
                GatewayServerConfig(
                    front,
                    tuple(self.engine_addresses),
                    self.tokenizer_address,
                    config.gateway_workers,
                ),
            ),
            lambda: _http_ok(f"{self.url}/health", self._probe_headers()),
            drain,
            output,
        )
        self.children = [self.tokenizer, *self.engines, self.gateway]
        # The engine and tokenizer admit only the gateway, by a token made for this run unless
        # the operator set one (to reach the internal services with their own clients too).
        # Secrets travel in the environment: a command line is visible to every user (ps).
        token = os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_urlsafe(32)
        for child in self.children:
            child.env[INTERNAL_TOKEN_ENV] = token
        self.gateway.env[API_KEYS_ENV] = ",".join(self.api_keys)

    def _probe_headers(self) -> dict[str, str]:
        if self.api_keys and self.config.front.policy.protect_health_metrics:
            return {"Authorization": f"Bearer {key_of(self.api_keys[0])}"}
        return {}

    @property
    def url(self) -> str:
        return f"{self.config.front.policy.scheme}://{_hostport(_local(self.host), self.port)}"

    @property
    def grpc_address(self) -> str:
        return _hostport(_local(self.host), self.grpc_port)

    # -- life cycle -------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the group to stop (safe in a signal handler and from any thread: it takes no
        lock); asking again later kills what is left."""
        now = time.monotonic()
        if self._stop_requested_at is None:
            self._stop_requested_at = now
        elif now - self._stop_requested_at >= FORCE_AFTER_SECONDS:
            self._force = True

    @property
    def stopping(self) -> bool:
        return self._stop_requested_at is not None

    def _pause(self) -> bool:
        """One poll's sleep, cut short by no one: True if a stop has been asked for by then."""
        if not self.stopping:
            time.sleep(POLL_SECONDS)
        return self.stopping

    def start(self) -> None:
        """Start all three and wait until each is healthy; ServeError if one dies or is late."""
        for child in self.children:
            child.start()
        deadline = time.monotonic() + self.config.startup_timeout
        pending = list(self.children)
        while pending and not self.stopping:
            self._raise_if_dead("during start-up")
            for child in [c for c in pending if c.healthy()]:
                pending.remove(child)
                print(f"folio: {child.name} healthy in {child.startup_seconds():.1f} s", flush=True)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise ServeError(f"{names} not healthy after {self.config.startup_timeout:.0f} s")
            if pending:
                self._pause()

    def watch(self) -> None:
        """Restart children that die; return when a stop is requested; ServeError when a child
        keeps dying."""
        while not self._pause():
            for child in self.children:
                if self.stopping:
                    break  # a restart must not race the stop
                self._tend(child)

    def _tend(self, child: Child) -> None:
        now = time.monotonic()
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.start()
                print(f"folio: restarted {child.name} (pid {child.pid})", flush=True)
        elif child.exit_code() is not None:
            self._schedule_restart(child, now)
        elif child.healthy_since is None and child.healthy():
            print(
                f"folio: {child.name} is serving again, {child.startup_seconds():.1f} s after "
                "its restart",
                flush=True,
            )

    def _schedule_restart(self, child: Child, now: float) -> None:
        recovered = child.healthy_since is not None and now - child.healthy_since >= STABLE_SECONDS
        child.deaths_in_a_row = 1 if recovered else child.deaths_in_a_row + 1
        died = f"{child.describe_exit()} while serving (pid {child.pid})"
        if child.deaths_in_a_row > self.config.max_restarts:
            raise ServeError(
                f"{died}: it died {child.deaths_in_a_row} times in a row, more "
                f"than --max-restarts {self.config.max_restarts} allows; giving up"
            )
        again = child.deaths_in_a_row - 1
        delay = (
            min(RESTART_DELAY_SECONDS * 2 ** (again - 1), MAX_RESTART_DELAY_SECONDS)
            if again
            else 0.0
        )
        child.restart_at = now + delay
        print(f"folio: {died}; restarting it in {delay:g} s", file=sys.stderr, flush=True)

    def _raise_if_dead(self, when: str) -> None:
        for child in self.children:
            if child.exit_code() is not None:
                raise ServeError(f"{child.describe_exit()} {when} (see its output)")

    def stop(self) -> bool:
        """Gateway first (it drains its clients), then engine and tokenizer.

        True if every child that was still running exited 0 on SIGTERM.
        """
        clean = self._stop_group([self.gateway])
        return self._stop_group([*self.engines, self.tokenizer]) and clean

    def _stop_group(self, children: list[Child]) -> bool:
        running = [c for c in children if c.process is not None and c.exit_code() is None]
        for child in running:
            child.terminate()
        deadline = time.monotonic() + max(c.drain_seconds for c in children) + KILL_MARGIN_SECONDS
        while any(c.exit_code() is None for c in running):
            if time.monotonic() > deadline or self._force:
                for child in running:
                    child.kill()
                break
            time.sleep(POLL_SECONDS)
        clean = True
        for child in running:
            if child.process is not None:
                child.process.wait()
            # A child still importing when SIGTERM came dies of it: that is a stop as asked.
            stopped_as_asked = child.exit_code() in (0, -signal.SIGTERM)
            print(
                f"folio: {child.describe_exit()} while stopping",
                file=sys.stdout if stopped_as_asked else sys.stderr,
                flush=True,
            )
            clean = clean and stopped_as_asked
        return clean


def serve(config: ServeConfig) -> int:
    """Run the three services until SIGINT / SIGTERM; 0 after a clean stop, 1 otherwise."""
    supervisor = Supervisor(config)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.request_stop())
    print(
        f"folio: starting tokenizer ({supervisor.tokenizer_address}), engine "
        f"({','.join(supervisor.engine_addresses)}) and gateway ({supervisor.url})",
        flush=True,
    )
    failed = False
    try:
        supervisor.start()
        if not supervisor.stopping:
            print(
                f"folio: serving on {supervisor.url} (OpenAI API under /v1; gateway gRPC "
                f"{supervisor.grpc_address}); Ctrl-C stops",
                flush=True,
            )
        supervisor.watch()
    except ServeError as exc:
        print(f"folio: error: {exc}; stopping the other services", file=sys.stderr, flush=True)
        failed = True
    finally:
        clean = supervisor.stop()  # whatever went wrong here, no child outlives `folio serve`
    if not failed:
        print("folio: stopped", flush=True)
    return 0 if clean and not failed else 1
