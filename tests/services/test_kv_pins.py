"""Pinned prefixes over real gRPC from a real engine on a tiny random-weight Llama: a request's
pin_ttl_seconds keeps its prompt's blocks through a flood of other prompts that evicts an
unpinned one, and a bad TTL fails the request alone, naming the field."""

from __future__ import annotations

import random

import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc

from common.config import EngineConfig
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.server import EngineService
from tiny_models import VARIANTS, make_checkpoint

BLOCK = 4
# 24 blocks: a 24-token prompt and its 3 tokens take 7; pins may hold 12.
ENGINE_ARGS = dict(
    dtype="float32", block_size=BLOCK, num_kv_blocks=24, max_num_batched_tokens=64, max_num_seqs=1
)
INVALID_ARGUMENT = 3  # google.rpc.Code

_rng = random.Random(11)


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint(directory, *VARIANTS["llama"])
    server = ServerThread(
        EngineService(EngineConfig(model=str(directory), **ENGINE_ARGS), "127.0.0.1", 0)
    )
    yield engine_pb2_grpc.EngineServiceStub(server.channel)
    server.close()


def fresh_prompt() -> list[int]:
    return [_rng.randrange(3, 150) for _ in range(24)]


def run(stub, rid: str, ids: list[int], pin_ttl_seconds: float = 0.0) -> engine_pb2.RequestOutput:
    """Generate 3 tokens greedily; the last output."""
    request = engine_pb2.GenerateRequest(
        add=engine_pb2.EngineRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=3, ignore_eos=True
            ),
            pin_ttl_seconds=pin_ttl_seconds,
        )
    )
    for response in stub.Generate(iter([request]), timeout=TIMEOUT):
        for out in response.outputs:
            if out.finished:
                return out
    raise AssertionError(f"{rid} never finished")


def test_a_pinned_prompt_outlives_a_flood_an_unpinned_one_does_not(stub):
    pinned, unpinned = fresh_prompt(), fresh_prompt()
    assert not run(stub, "pinned", pinned, pin_ttl_seconds=600).HasField("error")
    run(stub, "unpinned", unpinned)
    for i in range(4):
        run(stub, f"flood{i}", fresh_prompt())
    assert run(stub, "pinned again", [*pinned, 5]).usage.cached_tokens == 24
    assert run(stub, "unpinned again", [*unpinned, 5]).usage.cached_tokens == 0


@pytest.mark.parametrize("ttl", [-1.0, 7200.0])
def test_a_bad_ttl_fails_the_request_naming_the_field(stub, ttl):
    out = run(stub, f"bad{ttl}", fresh_prompt(), pin_ttl_seconds=ttl)
    assert out.error.code == INVALID_ARGUMENT
    assert "pin_ttl_seconds" in out.error.message
