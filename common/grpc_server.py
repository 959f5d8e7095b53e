"""What every Folio gRPC server shares: health, reflection, the warming -> serving -> draining
life cycle and a graceful stop on SIGTERM / SIGINT.

The server listens before the model is loaded so that orchestration can watch it warm up:
grpc.health.v1 says NOT_SERVING and RPCs answer UNAVAILABLE until `warm_up` returns, and again
once draining starts. A service given keys (`require_keys`: the internal token) answers
UNAUTHENTICATED to callers without one, except on grpc.health.v1 so that orchestrators can probe
it; messages are bounded by GRPC_MAX_MESSAGE_BYTES both ways. This module holds no service logic.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.auth import KeyInterceptor, KeySet
from common.config import GRPC_MESSAGE_OPTIONS
from common.errors import UnavailableError, status_code_for
from common.heap import freeze_loaded_heap

logger = logging.getLogger(__name__)
# A failed service lets the errors it already sent reach their callers, then stops.
FAILED_DRAIN_SECONDS = 1.0


class State(enum.Enum):
    WARMING = "warming up"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class GrpcService:
    """One gRPC server: subclasses register their servicers, load in `warm_up`, free in `close`."""

    # Full names of the served services, e.g. "folio.v1.EngineService".
    service_names: Sequence[str] = ()

    def __init__(self, host: str, port: int) -> None:
        self.address = f"{host}:{port}"
        self.state = State.WARMING
        self.port: int | None = None
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._serving = asyncio.Event()
        self._warm_up_task: asyncio.Task[None] | None = None
        self._stop_requested: asyncio.Event | None = None
        self.failure: BaseException | None = None
        self._interceptors: list[grpc.aio.ServerInterceptor] = []
        self.keys = KeySet()  # what callers must present (require_keys); empty: open
        self.key_name = ""
        self._options: list[tuple[str, Any]] = list(GRPC_MESSAGE_OPTIONS)
        self._credentials: grpc.ServerCredentials | None = None  # serve_tls's

    def share_port(self) -> None:
        """From `start` on, listen with SO_REUSEPORT: processes of one group serve one port."""
        self._options.append(("grpc.so_reuseport", 1))

    def serve_tls(self, keyfile: str, certfile: str) -> None:
        """From `start` on, listen with TLS: the private key and certificate chain (PEM
        files)."""
        with open(keyfile, "rb") as key, open(certfile, "rb") as chain:
            self._credentials = grpc.ssl_server_credentials([(key.read(), chain.read())])

    def require_keys(self, keys: KeySet, what: str, open_health: bool = True) -> None:
        """From `start` on, every call must present one of `keys` (authorization: Bearer),
        except health checks when `open_health`; `what` names the key in refusals."""
        self.keys, self.key_name = keys, what
        if keys:
            self._interceptors = [
                KeyInterceptor(keys, what, (health.SERVICE_NAME,) if open_health else ())
            ]

    def add_servicers(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def warm_up(self) -> None:
        """Load what the servicers need (runs after the port is open)."""

    async def drain(self, grace: float | None) -> None:
        """Let work in flight outside the gRPC server finish, for at most `grace` seconds (runs
        beside the server's own drain, before `close`)."""

    async def close(self) -> None:
        """Free what warm_up loaded (runs after the last RPC ended)."""

    def fail(self, error: BaseException) -> None:
        """The service cannot go on (event loop thread): `run` stops it at once and returns 1."""
        logger.error("%s failed: %s", type(self).__name__, error)
        self.failure = error
        if self._stop_requested is not None:
            self._stop_requested.set()

    def check_available(self) -> None:
        """Raise UnavailableError unless serving; servicers call it first."""
        if self.state is not State.SERVING:
            raise UnavailableError(f"the service is {self.state.value}; retry later")

    async def abort_unless_available(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """End the RPC with UNAVAILABLE unless serving (check_available as a gRPC status)."""
        try:
            self.check_available()
        except UnavailableError as exc:
            await context.abort(status_code_for(exc), str(exc))

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self) -> int:
        """Listen (NOT_SERVING), start warming up in the background; return the bound port."""
        server = grpc.aio.server(interceptors=self._interceptors, options=self._options)
        self.add_servicers(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = (
            server.add_insecure_port(self.address)
            if self._credentials is None
            else server.add_secure_port(self.address, self._credentials)
        )
        await server.start()
        self._server = server
        self._warm_up_task = asyncio.create_task(self._warm_up())
        return self.port

    async def _warm_up(self) -> None:
        await self.warm_up()
        freeze_loaded_heap(f"{type(self).__name__} warm-up")
        if self.state is State.WARMING:
            self.state = State.SERVING
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self._serving.set()
            logger.info("%s serving on port %d", type(self).__name__, self.port)

    async def wait_serving(self) -> None:
        """Return once warm; raise what warm-up raised if it failed."""
        warm_up = self._warm_up_task
        assert warm_up is not None, "start() first"
        serving = asyncio.create_task(self._serving.wait())
        await asyncio.wait({serving, warm_up}, return_when=asyncio.FIRST_COMPLETED)
        serving.cancel()
        failure = warm_up.exception() if warm_up.done() else None
        if failure is not None:
            raise failure

    async def stop(self, grace: float | None) -> None:
        """Drain: NOT_SERVING, refuse new work, let RPCs in flight finish for `grace` seconds."""
        if self.state is State.STOPPED:
            return
        self.state = State.DRAINING
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._warm_up_task is not None and not self._warm_up_task.done():
            self._warm_up_task.cancel()
        await asyncio.gather(
            *([self._server.stop(grace)] if self._server is not None else []), self.drain(grace)
        )
        await self.close()
        self.state = State.STOPPED

    async def run(self, grace: float) -> int:
        """Serve until SIGTERM or SIGINT, then drain for at most `grace` seconds; 0, or 1 when
        the service failed (`fail`): then the drain is short, what was live has been failed."""
        stop = self._stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        port = await self.start()
        print(
            f"folio: {type(self).__name__} listening on {self.address.rsplit(':', 1)[0]}:{port}",
            flush=True,
        )
        warm_up = self._warm_up_task
        assert warm_up is not None  # start() made it
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({stopped, warm_up}, return_when=asyncio.FIRST_COMPLETED)
            if warm_up.done():
                warm_up.result()  # a failed warm-up ends the process with its error
                await stopped
        finally:
            await self.stop(grace if self.failure is None else FAILED_DRAIN_SECONDS)
        return 0 if self.failure is None else 1

    async def _set_health(self, status: int) -> None:
        # "" is the whole server, as standard health clients (grpc_health_probe) ask by default.
        for name in ("", *self.service_names):
            await self._health.set(name, status)
