"""Service test helpers: a real grpc.aio server on loopback, run on its own event loop in a
background thread so that the tests drive it with plain blocking gRPC stubs."""

from __future__ import annotations

import asyncio
import queue
import threading

import grpc

from services.grpc_server import GrpcService

# Every blocking call gets a deadline: a broken server fails a test instead of hanging it.
TIMEOUT = 60


class ServerThread:
    def __init__(self, service: GrpcService, wait: bool = True) -> None:
        self.service = service
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self.call(service.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        if wait:
            self.call(service.wait_serving())

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(TIMEOUT)

    def close(self) -> None:
        self.channel.close()
        self.call(self.service.stop(grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(TIMEOUT)
        self.loop.close()


class RequestStream:
    """The client side of a bidirectional stream, fed message by message from the test."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()

    def __iter__(self):
        while (message := self._queue.get()) is not None:
            yield message

    def send(self, message) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
