"""The engine's Generate socket: Generate's stream on a plain TCP connection beside the gRPC
server (frames and messages: GenerateSocketOpen in protos/folio/v1/engine.proto).

Why it exists: on a stream's every step, gRPC's Python server hands the message from the engine's
loop thread to the event loop, to gRPC's core, to its event-engine thread: each hop a wake-up, on
the cores the engine's own threads compute on, and at one stream a step's message costs more
than its tokens are worth. Here the engine's loop thread writes a step's frame to the
connection itself (one non-blocking send; only what the kernel's buffer cannot take waits for the
event loop), and the event loop reads the client's messages. A connection's requests are a
GenerateSession, as a gRPC stream's are; this module only moves frames and never decides what a
request means.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

import grpc
from common.grpc_stubs.folio.v1 import engine_pb2 as pb
from google.protobuf.message import DecodeError

from common.auth import bearer_token
from common.errors import UnavailableError
from common.framing import FrameError, FrameReader, frame
from engine.async_engine import AsyncEngine, Event
from services.engine.convert import event_to_proto
from services.engine.generate_session import MALFORMED_MESSAGE, GenerateSession, unreadable

if TYPE_CHECKING:
    from services.engine.server import EngineService

logger = logging.getLogger(__name__)
# How long a new connection may take to send its GenerateSocketOpen.
OPEN_SECONDS = 10.0
# How long a closing connection's unsent frames may take to leave.
FLUSH_SECONDS = 5.0
# How long to wait before accepting again after accepting failed.
ACCEPT_RETRY_SECONDS = 0.1
# How often a drain looks whether the connections' requests have ended.
DRAIN_POLL_SECONDS = 0.05
_READ_BYTES = 1 << 16
_READY = frame(pb.GenerateSocketFrame(ready=pb.GenerateSocketReady()).SerializeToString())


def _end_frame(code: grpc.StatusCode, message: str) -> bytes:
    end = pb.GenerateSocketEnd(code=code.value[0], message=message)
    return frame(pb.GenerateSocketFrame(end=end).SerializeToString())


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket listening on host:port (0: a free port)."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.create_server(address, family=family)
    listener.setblocking(False)
    return listener


class FrameWriter:
    """Frames out on one non-blocking socket, from any thread, in the order they were sent: a
    frame goes straight to the kernel when nothing waits before it; the rest is left to the
    event loop to send as the peer reads."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = sock
        self._loop = loop
        self._lock = threading.Lock()
        self._pending = bytearray()  # sent by the loop's flush, ahead of any new frame
        self._closed = False
        self._flush: asyncio.Task[None] | None = None  # loop thread only

    def send(self, data: bytes, last: bool = False) -> None:
        """Send a frame (`last`: nothing after it, and the connection's reader then sees it
        end); a frame after the last, or after the peer went away, is dropped (the reader sees
        the peer leave)."""
        with self._lock:
            if self._closed:
                return
            self._closed = last
            if last:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RD)
            if self._pending:
                self._pending += data
                return
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._closed = True
                return
            if sent == len(data):
                return
            self._pending += data[sent:]
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self._loop.call_soon_threadsafe(self._start_flush)

    def _start_flush(self) -> None:
        if self._flush is None or self._flush.done():
            self._flush = self._loop.create_task(self._send_pending())

    async def _send_pending(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                data = bytes(self._pending)
            try:
                await self._loop.sock_sendall(self._sock, data)
            except OSError:
                with self._lock:
                    self._closed = True
                    self._pending.clear()
                return
            with self._lock:
                del self._pending[: len(data)]

    async def close(self) -> None:
        """Let what is pending leave (for at most FLUSH_SECONDS), then close the socket."""
        with self._lock:
            self._closed = True
        if self._flush is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._flush), FLUSH_SECONDS)
            self._flush.cancel()
        self._sock.close()


class _SocketStream:
    """One connection's stream: its session, and its steps' frames written in the engine's loop
    thread (the session's EventSink)."""

    def __init__(self, service: EngineService, engine: AsyncEngine, writer: FrameWriter) -> None:
        self._writer = writer
        self.session = GenerateSession(service, engine, self, self.send)

    def deliver(self, events: list[Event]) -> None:
        self.session.count(events)
        self.send(pb.GenerateResponse(outputs=[event_to_proto(e) for e in events]))

    def send(self, response: pb.GenerateResponse) -> None:
        try:
            data = frame(pb.GenerateSocketFrame(response=response).SerializeToString())
        except FrameError as exc:  # as gRPC's send would: the stream ends, its requests abort
            self._writer.send(_end_frame(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)), True)
            return
        self._writer.send(data)


class GenerateSocket:
    """The listening socket and its connections, on the service's event loop."""

    def __init__(self, service: EngineService, host: str, port: int) -> None:
        self._service = service
        self._listener = listening_socket(host, port)
        self.port: int = self._listener.getsockname()[1]
        self._streams: set[_SocketStream] = set()
        self._connections: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Accept connections (in the running loop); they open once the service serves."""
        self._accepting = asyncio.create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: the next try may succeed
                logger.warning("Generate socket: accepting a connection failed: %s", exc)
                await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(self._serve(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        writer = FrameWriter(sock, loop)
        reader = FrameReader()
        stream: _SocketStream | None = None
        try:
            payloads = await asyncio.wait_for(self._read(sock, reader), OPEN_SECONDS)
            if not payloads:  # the peer left before its open
                return
            refusal = self._refusal(payloads[0])
            if refusal is not None:
                writer.send(_end_frame(*refusal), last=True)
                return
            assert self._service.engine is not None  # serving: warm-up built it
            stream = _SocketStream(self._service, self._service.engine, writer)
            self._streams.add(stream)
            writer.send(_READY)
            messages = payloads[1:]
            while True:
                for payload in messages:
                    if (failure := self._handle(stream.session, payload)) is not None:
                        writer.send(_end_frame(grpc.StatusCode.INVALID_ARGUMENT, failure), True)
                        return
                messages = await self._read(sock, reader)
                if not messages:
                    return  # the peer closed: its requests are aborted below
        except FrameError as exc:
            writer.send(_end_frame(grpc.StatusCode.INVALID_ARGUMENT, str(exc)), last=True)
        except (TimeoutError, OSError) as exc:
            logger.debug("Generate socket connection ended: %s", exc)
        except Exception as exc:  # a bug of this module's: the peer hears INTERNAL, once
            logger.exception("Generate socket connection failed")
            writer.send(_end_frame(grpc.StatusCode.INTERNAL, f"internal error: {exc}"), True)
        finally:
            if stream is not None:
                self._streams.discard(stream)
                stream.session.abort_live()
            await writer.close()

    @staticmethod
    def _handle(session: GenerateSession, payload: bytes) -> str | None:
        """Act on one client message; why the stream must end, if it must (as gRPC's Generate
        ends for a message it cannot read, or one without an action). A failure acting on a
        readable message is this service's own: it propagates (INTERNAL, logged)."""
        try:
            message = pb.GenerateRequest.FromString(payload)
        except DecodeError as exc:
            return unreadable(exc)
        return None if session.handle(message) else MALFORMED_MESSAGE

    @staticmethod
    async def _read(sock: socket.socket, reader: FrameReader) -> list[bytes]:
        """The next whole frames' payloads; [] once the peer has closed."""
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(sock, _READ_BYTES)
            if not data:
                return []
            if payloads := reader.feed(data):
                return payloads

    def _refusal(self, payload: bytes) -> tuple[grpc.StatusCode, str] | None:
        """Why a connection whose first frame is `payload` may not open, if it may not."""
        try:
            opening = pb.GenerateSocketOpen.FromString(payload)
        except DecodeError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, f"a GenerateSocketOpen first: {exc}"
        keys = self._service.keys
        if keys and keys.identify(bearer_token(opening.authorization)) is None:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing or invalid {self._service.key_name}: send GenerateSocketOpen "
                "authorization: Bearer <key>",
            )
        try:
            self._service.check_available()
        except UnavailableError as exc:
            return grpc.StatusCode.UNAVAILABLE, str(exc)
        return None

    async def drain(self, grace: float | None) -> None:
        """Accept no more connections; let the requests of those open end (for at most `grace`
        seconds), then close them, which aborts what is left."""
        if self._accepting is not None:
            self._accepting.cancel()
        self._listener.close()
        deadline = None if grace is None else time.monotonic() + grace
        while any(not s.session.idle for s in self._streams) and (
            deadline is None or time.monotonic() < deadline
        ):
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
