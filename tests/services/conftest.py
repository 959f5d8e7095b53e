"""Fixtures of the service tests."""

from __future__ import annotations

import pytest

from common.grpc_server import GrpcService
from grpc_helpers import ServerThread
from tiny_models import VARIANTS, make_checkpoint


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


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random-weight Llama with a 4096-token context: room for requests that must still
    run when a test acts on them."""
    directory = tmp_path_factory.mktemp("llama")
    config_class, kwargs = VARIANTS["llama"]
    make_checkpoint(directory, config_class, dict(kwargs, max_position_embeddings=4096))
    return directory
