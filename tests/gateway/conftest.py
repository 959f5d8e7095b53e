"""Fixtures of the gateway tests: real tokenizer and engine services on loopback with the
default model, and the real gateway (uvicorn + gRPC) on its own event loop in a thread."""

from __future__ import annotations

import pytest
from common.grpc_stubs.folio.v1 import engine_pb2_grpc

from common.config import EngineConfig
from common.tokenizer import Tokenizer
from gateway_helpers import ENGINE_ARGS, GatewayThread
from grpc_helpers import ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService


@pytest.fixture(scope="session")
def tokenizer(default_model_dir) -> Tokenizer:
    """The tokenizer library itself: the reference the gateway's counts are checked against."""
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="package")
def services(default_model_dir):
    tokenizer = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    engine = ServerThread(
        EngineService(EngineConfig(model=str(default_model_dir), **ENGINE_ARGS), "127.0.0.1", 0)
    )
    yield engine, tokenizer
    engine.close()
    tokenizer.close()


@pytest.fixture(scope="package")
def gateway(services):
    engine, tokenizer = services
    server = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
    yield server
    server.close()


@pytest.fixture(scope="package")
def engine_stub(services) -> engine_pb2_grpc.EngineServiceStub:
    return engine_pb2_grpc.EngineServiceStub(services[0].channel)
