"""Fixtures of the service tests."""

from __future__ import annotations

import pytest

from grpc_helpers import ServerThread
from services.grpc_server import GrpcService


@pytest.fixture
def serve():
    """serve(service, wait=True) -> ServerThread; stopped after the test."""
    started: list[ServerThread] = []

    def start(service: GrpcService, wait: bool = True) -> ServerThread:
        started.append(ServerThread(service, wait))
        return started[-1]

    yield start
    for server in started:
        server.close()
