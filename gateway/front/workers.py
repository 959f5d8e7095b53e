"""`folio gateway --workers N`: N gateway processes behind the same HTTP and gRPC ports.

The parent binds the HTTP socket and the workers inherit it, as uvicorn's workers do: each
connection goes to whichever worker accepts it first. gRPC cannot take a socket made elsewhere,
so the parent reserves the gRPC port with a bound, never-listening SO_REUSEPORT socket (it also
turns port 0 into a number) and every worker listens on that port with grpc.so_reuseport.

Each worker is a whole gateway of its own (`folio gateway` with the same flags): its own engine
and tokenizer streams, and its own routing index built from the engines' KV events, so the
workers agree. What must stay whole lives in a private directory the parent makes and removes:
the request-level metrics (prometheus-client multiprocess files, PROMETHEUS_MULTIPROC_DIR) that
any worker's /metrics sums, and the rate-limit buckets (gateway/limits/shared_buckets.py) that make
a caller's limit the whole server's.

The parent prints the listening line once every worker serves. SIGTERM / SIGINT go on to every
worker, each drains its own requests, and the parent waits for all of them (killing what is left
drain + KILL_MARGIN_SECONDS later). A worker that dies while serving is reported and started
again after RESTART_DELAY_SECONDS (the others keep serving meanwhile; its counters stay in the
sums, its gauges leave them); one that dies before it serves (a bad flag, a busy port) stops the
group with an error. This module only starts, watches and stops processes: it never handles a
request and imports nothing of the gateway's serving code.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead

from common.parent_death import child_env
from gateway.front.sockets import listening_socket, reserve_port

# How often the parent looks at its workers.
POLL_SECONDS = 0.05
# How long every worker may take to serve after it starts.
STARTUP_SECONDS = 120.0
# A worker that died while serving starts again this much later.
RESTART_DELAY_SECONDS = 1.0
# After SIGTERM, how much longer than the drain time a worker gets before it is killed.
KILL_MARGIN_SECONDS = 5.0
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker is given by its parent."""

    index: int
    listen_fd: int  # the HTTP socket the parent listens on, inherited
    shared_state: Path  # the private directory of the group

    def mark_ready(self) -> None:
        """Tell the parent this worker serves."""
        _ready_file(self.shared_state, os.getpid()).touch()


def _ready_file(shared_state: Path, pid: int) -> Path:
    return shared_state / f"ready-{pid}"


def _metrics_dir(shared_state: Path) -> Path:
    """Where the workers' metrics files live (PROMETHEUS_MULTIPROC_DIR)."""
    return shared_state / "metrics"


@dataclass(eq=False)
class _Worker:
    index: int
    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    serving: bool = False  # since its last start
    restart_at: float | None = None  # monotonic; while it waits to start again

    def describe_exit(self) -> str:
        assert self.process is not None
        code = self.process.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
        return f"gateway worker {self.index} (pid {self.process.pid}) {how}"


@dataclass(eq=False)
class WorkerGroup:
    """The parent of N gateway workers; run() until a stop, then its exit status."""

    command: list[str]  # the `folio gateway` flags the workers share (after `folio`)
    host: str
    port: int
    grpc_port: int
    workers: int
    drain_seconds: float
    scheme: str = "http"  # the workers' (GatewayConfig.scheme)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> int:
        http = listening_socket(self.host, self.port)
        grpc_reservation = reserve_port(self.host, self.grpc_port)
        shared_state = Path(tempfile.mkdtemp(prefix="folio-gateway-"))
        try:
            _metrics_dir(shared_state).mkdir()
            port, grpc_port = http.getsockname()[1], grpc_reservation.getsockname()[1]
            workers = [
                _Worker(i, self.worker_command(i, grpc_port, http.fileno(), shared_state))
                for i in range(self.workers)
            ]
            env = {METRICS_DIR_ENV: str(_metrics_dir(shared_state))}
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stop.set())
            for worker in workers:
                self._start(worker, http, env)
            try:
                self._wait_serving(workers, shared_state, port, grpc_port)
                self._watch(workers, shared_state, http, env)
            except _GroupFailed as exc:
                print(f"folio: error: {exc}; stopping the gateway", file=sys.stderr, flush=True)
                self._stop_all(workers)
                return 1
            return 0 if self._stop_all(workers) else 1
        finally:
            http.close()
            grpc_reservation.close()
            shutil.rmtree(shared_state, ignore_errors=True)

    def worker_command(
        self, index: int, grpc_port: int, listen_fd: int, shared_state: Path
    ) -> list[str]:
        """Worker `index`'s command line (after `folio`): the group's flags, then its own."""
        return [
            *self.command,
            # Later flags win: each worker is one process on the reserved port.
            "--workers",
            "1",
            "--grpc-port",
            str(grpc_port),
            "--worker-index",
            str(index),
            "--listen-fd",
            str(listen_fd),
            "--shared-state",
            str(shared_state),
        ]

    def _start(self, worker: _Worker, http: socket.socket, env: dict[str, str]) -> None:
        worker.serving = False
        worker.restart_at = None
        # A process group of its own: a terminal's Ctrl-C reaches only the parent, which
        # passes SIGTERM on to every worker.
        worker.process = subprocess.Popen(
            [sys.executable, "-m", "folio.cli", *worker.command],
            stdin=subprocess.DEVNULL,
            pass_fds=(http.fileno(),),
            env=child_env(env),  # it dies with the parent, even a SIGKILLed one
            process_group=0,
        )

    def _wait_serving(
        self, workers: list[_Worker], shared_state: Path, port: int, grpc_port: int
    ) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self._stop.is_set():
            for worker in workers:
                assert worker.process is not None
                if worker.process.poll() is not None:
                    raise _GroupFailed(f"{worker.describe_exit()} during start-up")
                worker.serving = (
                    worker.serving or _ready_file(shared_state, worker.process.pid).exists()
                )
            if all(w.serving for w in workers):
                print(
                    f"folio: gateway listening on {self.scheme}://{self.host}:{port} "
                    f"(gRPC {self.host}:{grpc_port})",
                    flush=True,
                )
                print(
                    f"folio: {len(workers)} gateway workers, pids "
                    + " ".join(str(w.process.pid) for w in workers if w.process is not None),
                    flush=True,
                )
                return
            if time.monotonic() > deadline:
                raise _GroupFailed(f"gateway workers not serving after {STARTUP_SECONDS:.0f} s")
            self._stop.wait(POLL_SECONDS)

    def _watch(
        self,
        workers: list[_Worker],
        shared_state: Path,
        http: socket.socket,
        env: dict[str, str],
    ) -> None:
        while not self._stop.wait(POLL_SECONDS):
            for worker in workers:
                assert worker.process is not None
                if worker.restart_at is not None:
                    if time.monotonic() >= worker.restart_at:
                        self._start(worker, http, env)
                        print(
                            f"folio: restarted gateway worker {worker.index} "
                            f"(pid {worker.process.pid})",
                            flush=True,
                        )
                elif worker.process.poll() is not None:
                    if not worker.serving:
                        raise _GroupFailed(f"{worker.describe_exit()} before it served")
                    # Its view of the replicas (live gauges) must not outlive it.
                    mark_process_dead(  # type: ignore[no-untyped-call]
                        worker.process.pid, str(_metrics_dir(shared_state))
                    )
                    worker.restart_at = time.monotonic() + RESTART_DELAY_SECONDS
                    print(
                        f"folio: {worker.describe_exit()} while serving; restarting it in "
                        f"{RESTART_DELAY_SECONDS:g} s",
                        file=sys.stderr,
                        flush=True,
                    )
                elif not worker.serving and _ready_file(shared_state, worker.process.pid).exists():
                    worker.serving = True

    def _stop_all(self, workers: list[_Worker]) -> bool:
        """SIGTERM to every worker, wait for all to drain; True if each exited 0."""
        running = [w.process for w in workers if w.process is not None and w.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_seconds + KILL_MARGIN_SECONDS
        clean = True
        for process in running:
            try:
                process.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            # A worker still importing when SIGTERM came dies of it: a stop as asked.
            clean = clean and process.returncode in (0, -signal.SIGTERM)
        return clean


class _GroupFailed(RuntimeError):
    pass
