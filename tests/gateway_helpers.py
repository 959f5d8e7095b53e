"""Test helper for the gateway tests: the engine settings they share and a GatewayServer run
on an event loop of its own, so tests can use blocking clients."""

from __future__ import annotations

import grpc
from grpc_helpers import TIMEOUT, LoopThread

from common.grpc_stubs.folio.v1 import engine_pb2, engine_pb2_grpc
from gateway.server import GatewayServer

# Prefix caching off: a prompt computed partly from cached blocks rounds differently in bf16,
# and the tests compare runs of the same prompt token for token.
MAX_MODEL_LEN = 1024
ENGINE_ARGS = dict(dtype="bfloat16", num_kv_blocks=512, max_model_len=MAX_MODEL_LEN,
                   max_num_seqs=16, enable_prefix_caching=False)


class GatewayThread(LoopThread):
    """A GatewayServer on an event loop of its own, so tests use blocking clients."""

    def __init__(self, engine_address: str, tokenizer_address: str) -> None:
        super().__init__()
        self.server = GatewayServer("127.0.0.1", 0, 0, engine_address, tokenizer_address)
        self.call(self.server.start())
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.grpc_channel = grpc.insecure_channel(f"127.0.0.1:{self.server.grpc_port}")

    def close(self) -> None:
        self.grpc_channel.close()
        self.call(self.server.stop(grace=1))
        self.stop_loop()


def engine_stats(stub: engine_pb2_grpc.EngineServiceStub) -> engine_pb2.GetStatsResponse:
    return stub.GetStats(engine_pb2.GetStatsRequest(), timeout=TIMEOUT)
