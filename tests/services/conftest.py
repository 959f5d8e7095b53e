"""Fixtures of the service tests."""

from __future__ import annotations

import pytest

from common.grpc_server import GrpcService
from grpc_helpers import ServerThread


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
