"""Service test helpers: a real grpc.aio server on loopback, run on its own event loop in a
background thread so that the tests drive it with plain blocking gRPC stubs."""

from __future__ import annotations

import asyncio
import queue
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.grpc_server import GrpcService

# Every blocking call gets a deadline: a broken server fails a test instead of hanging it.
TIMEOUT = 60


class LoopThread:
    """An asyncio event loop in a background thread: servers run there, tests stay blocking."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(TIMEOUT)

    def stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(TIMEOUT)
        self.loop.close()


class ServerThread(LoopThread):
    def __init__(self, service: GrpcService, wait: bool = True) -> None:
        super().__init__()
        self.service = service
        self.port = self.call(service.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        if wait:
            self.call(service.wait_serving())

    def close(self) -> None:
        self.channel.close()
        self.call(self.service.stop(grace=0))
        self.stop_loop()


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


def assert_health_and_reflection(channel: grpc.Channel, service: str) -> None:
    """The service reports SERVING (overall and by name) and reflection lists it and returns
    its descriptors, so a client can call it knowing nothing."""
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", service):
        answer = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    [answer] = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    [answer] = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)]),
        timeout=TIMEOUT,
    )
    assert answer.file_descriptor_response.file_descriptor_proto
