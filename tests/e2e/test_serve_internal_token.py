"""`folio serve` guards its internal services: the tokenizer and the engine admit only callers
with the token made for this run, which the three children get in their environment and never
on their command lines; the gateway, which has it, serves as usual."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
from common.grpc_stubs.folio.v1 import engine_pb2, engine_pb2_grpc, tokenizer_pb2_grpc
from common.grpc_stubs.folio.v1 import tokenizer_pb2 as tok_pb2

from grpc_helpers import TIMEOUT


def environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def test_internal_services_need_the_token_of_the_run(folio_server):
    children = folio_server.children()
    assert len(children) == 3
    tokens = {environment(pid).get("FOLIO_INTERNAL_TOKEN") for pid in children}
    assert len(tokens) == 1
    token = tokens.pop()
    # start_serve sets FOLIO_INTERNAL_TOKEN: an operator's token is used rather than a new one.
    assert token == folio_server.internal_token
    assert token and not any(token in command_line for command_line in children.values())

    with (
        grpc.insecure_channel(folio_server.engine_address) as engine_channel,
        grpc.insecure_channel(folio_server.tokenizer_address) as tokenizer_channel,
    ):
        engine = engine_pb2_grpc.EngineServiceStub(engine_channel)
        tokenizer = tokenizer_pb2_grpc.TokenizerServiceStub(tokenizer_channel)
        calls = [
            lambda m: engine.GetModelInfo(
                engine_pb2.GetModelInfoRequest(), metadata=m, timeout=TIMEOUT
            ),
            lambda m: tokenizer.Tokenize(
                tok_pb2.TokenizeRequest(text="Hi"), metadata=m, timeout=TIMEOUT
            ),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as failure:
                call(())
            assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert call((("authorization", f"Bearer {token}"),))
    response = httpx.post(
        f"{folio_server.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert response.status_code == 200, response.text
