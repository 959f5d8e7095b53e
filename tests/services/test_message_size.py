"""gRPC message sizes are bounded on every Folio server (GrpcService, which the gateway's public
gRPC API is one of): a message over GRPC_MAX_MESSAGE_BYTES is refused with RESOURCE_EXHAUSTED
before it is parsed, while one over gRPC's 4 MiB default but within the bound still arrives."""

from __future__ import annotations

import grpc
import pytest
from common.grpc_stubs.folio.v1 import tokenizer_pb2 as tok_pb2
from common.grpc_stubs.folio.v1 import tokenizer_pb2_grpc

from common.config import GRPC_MAX_MESSAGE_BYTES
from grpc_helpers import TIMEOUT
from services.tokenizer.server import TokenizerService

# An id outside any vocabulary takes 3 bytes on the wire and is refused at once once received.
FOREIGN_ID = 2_000_000


def detokenize_bytes(stub, size: int):
    """A Detokenize call whose request is about `size` bytes."""
    return stub.Detokenize(
        tok_pb2.DetokenizeRequest(token_ids=[FOREIGN_ID] * (size // 3)), timeout=TIMEOUT
    )


def test_messages_over_the_bound_are_refused(serve, default_model_dir):
    tokenizer = serve(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(tokenizer.channel)
    with pytest.raises(grpc.RpcError) as failure:
        detokenize_bytes(stub, 6 * 1024 * 1024)  # over gRPC's default, within the bound
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # it arrived
    assert "token_ids" in failure.value.details()
    with pytest.raises(grpc.RpcError) as failure:
        detokenize_bytes(stub, GRPC_MAX_MESSAGE_BYTES + 1024)
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
