"""The gateway process: the HTTP app on uvicorn and the gRPC GatewayService, both in one asyncio
loop, sharing one Gateway (clients, metrics, drain state) and one Access (API keys and rate
limits: a key's limits hold across both APIs).

Start-up binds both ports and prints the ready line; SIGTERM / SIGINT drain: new requests get
503 / UNAVAILABLE, requests in flight get up to drain_seconds, then both servers stop. As one of
the workers of `folio gateway --workers N` (gateway/front/workers.py), it serves on the HTTP socket
its parent made, shares the gRPC port, counts its metrics in multiprocess mode and keeps its
rate-limit buckets in the group's shared state. Wiring and life cycle only: no request handling
here.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Iterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.config import GatewayConfig
from gateway.batch.service import BatchService
from gateway.engines.clients import EngineClient, TokenizerClient
from gateway.engines.replica_metrics import ReplicaCollector
from gateway.front.app import build_app
from gateway.front.grpc_service import GatewayGrpcService
from gateway.front.sockets import listening_socket
from gateway.front.workers import WorkerSetup
from gateway.limits.auth import Access
from gateway.metrics import Metrics
from gateway.pipeline.generation import Gateway

WORKER_HEADER = "x-folio-gateway-worker"


class _NamingWorker:
    """The app, each HTTP response naming the worker that answered (x-folio-gateway-worker:
    its index), to tell which process served a request."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self._app = app
        self._header = (WORKER_HEADER.encode(), str(index).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def send_naming_worker(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self._app(scope, receive, send_naming_worker)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, its main loop ticking once a second instead of ten times, and woken at
    once when told to exit.

    uvicorn's tick polls should_exit and renews the Date header once a second: ten wake-ups a
    second cost an idle gateway more CPU than anything else, and with a slow model that counts
    per output token. The Date header keeps its one-second resolution; a stop waits for no tick.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_requested = False
        self._tick: asyncio.Future[None] | None = None  # what main_loop waits on, between ticks
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit_requested

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        # Set from the loop's own thread (GatewayServer.stop), as futures require.
        self._exit_requested = value
        if value:
            self._wake()

    def _wake(self) -> None:
        if self._tick is not None and not self._tick.done():
            self._tick.set_result(None)

    async def main_loop(self) -> None:
        # on_tick renews the Date header on counts that are multiples of ten: every tick here.
        # A future and a timer per tick: asyncio.wait_for would add a task and its cancellation.
        loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000
            self._tick = loop.create_future()
            timer = loop.call_later(1.0, self._wake)
            await self._tick
            timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The gateway drains on signals itself; uvicorn must not take them over.
        yield


class GatewayServer:
    def __init__(
        self,
        host: str,
        port: int,
        grpc_port: int,
        engine_address: str | Sequence[str],
        tokenizer_address: str,
        served_model_names: Sequence[str] = (),
        config: GatewayConfig | None = None,
        internal_token: str | None = None,
        worker: WorkerSetup | None = None,
    ) -> None:
        """`engine_address`: one engine, or each replica's. `internal_token`: what the engine
        and tokenizer require of callers, if anything. `worker`: this gateway is one of a
        group's workers (then `port` is unused: it serves on the inherited socket)."""
        self.host = host
        self.port = port
        self.grpc_port = grpc_port
        self._engine_addresses = (
            [engine_address] if isinstance(engine_address, str) else list(engine_address)
        )
        self._tokenizer_address = tokenizer_address
        self._served_model_names = served_model_names
        self.config = config or GatewayConfig()
        self._internal_token = internal_token
        self.worker = worker
        self.gateway: Gateway | None = None
        self._grpc: GatewayGrpcService | None = None
        self.app: Starlette | None = None  # once started
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task[None] | None = None
        self.batches: BatchService | None = None  # the batch jobs, once started

    async def start(self) -> None:
        """Listen on both ports (0 picks free ones; self.port and self.grpc_port say which)."""
        # gRPC channels belong to the running loop: create the clients here, not in __init__.
        worker = self.worker
        metrics = Metrics(multiprocess=worker is not None)
        self.gateway = Gateway(
            [EngineClient(address, self._internal_token) for address in self._engine_addresses],
            TokenizerClient(self._tokenizer_address, self._internal_token),
            metrics,
            self._served_model_names,
            self.config.routing_policy,
        )
        pool = self.gateway.engine
        metrics.registry.register(ReplicaCollector(pool.replicas))
        pool.start()
        access = Access(self.config, None if worker is None else worker.shared_state)
        self._grpc = GatewayGrpcService(
            self.gateway, self.host, self.grpc_port, self.config, access
        )
        if worker is not None:
            self._grpc.share_port()
        self.grpc_port = await self._grpc.start()
        # Bound here rather than by uvicorn, so that a busy port raises instead of exiting.
        sock = (
            listening_socket(self.host, self.port)
            if worker is None
            else socket.socket(fileno=worker.listen_fd)
        )
        self.port = sock.getsockname()[1]
        self.batches = BatchService(self.gateway, self.config)
        self.app = build_app(self.gateway, self.batches, self.config, access)
        config = uvicorn.Config(
            self.app if worker is None else _NamingWorker(self.app, worker.index),
            # httptools: uvicorn's C parser and writer; h11's pure-Python state machine cost
            # more CPU per streamed chunk.
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_keep_alive=30,
            ssl_keyfile=self.config.ssl_keyfile,
            ssl_certfile=self.config.ssl_certfile,
        )
        self._http = http = _Uvicorn(config)
        self._http_task = http_task = asyncio.create_task(http.serve(sockets=[sock]))
        while not http.started:
            if http_task.done():
                http_task.result()
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        self.batches.start()  # jobs left unfinished by the last run resume here

    def _started(self) -> tuple[Gateway, GatewayGrpcService, _Uvicorn, asyncio.Task[None]]:
        """What start() made; RuntimeError before then."""
        if (
            self.gateway is None
            or self._grpc is None
            or self._http is None
            or self._http_task is None
        ):
            raise RuntimeError("the gateway server has not been started")
        return self.gateway, self._grpc, self._http, self._http_task

    async def stop(self, grace: float) -> None:
        """Drain: refuse new requests, let those in flight finish for `grace` s, then close."""
        gateway, grpc_service, http, http_task = self._started()
        assert self.batches is not None
        deadline = time.monotonic() + grace
        # The batch runner first: it must start no line once the gateway refuses new requests.
        await asyncio.gather(
            self.batches.stop(grace), gateway.drain(grace), grpc_service.stop(grace)
        )
        # Responses may still be writing their last events: uvicorn waits for them. It declares
        # this an int but hands it to asyncio.wait_for, which takes fractions of a second.
        http.config.timeout_graceful_shutdown = max(  # type: ignore[assignment]
            deadline - time.monotonic(), 0.5
        )
        http.should_exit = True
        await http_task
        self.batches.close()
        await gateway.engine.close()
        await gateway.tokenizer.close()

    async def run(self, grace: float) -> None:
        """Serve until SIGTERM or SIGINT, then drain for at most `grace` seconds."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        if self.worker is None:
            print(
                f"folio: gateway listening on {self.config.scheme}://{self.host}:{self.port} "
                f"(gRPC {self.host}:{self.grpc_port})",
                flush=True,
            )
        else:  # the parent says where the group listens, once every worker serves
            self.worker.mark_ready()
        http_task = self._started()[3]
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({stopped, http_task}, return_when=asyncio.FIRST_COMPLETED)
            if http_task.done():
                http_task.result()  # the HTTP server died: end with its error
        finally:
            stopped.cancel()
            await self.stop(grace)
