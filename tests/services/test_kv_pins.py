"""Pinned prefixes over real gRPC from a real engine on a tiny random-weight Llama: a request's
pin_ttl_seconds keeps its prompt's blocks through a flood of other prompts that evicts an
unpinned one; pins are bounded per owner (pin_owner, pin_owner_max_bytes), an owner pinning the
same prefix again counting it once; a bad TTL fails the request alone, naming the field."""

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
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint(directory, *VARIANTS["llama"])
    return directory


def serve(directory):
    return ServerThread(
        EngineService(EngineConfig(model=str(directory), **ENGINE_ARGS), "127.0.0.1", 0)
    )


@pytest.fixture(scope="module")
def stub(llama):
    server = serve(llama)
    yield engine_pb2_grpc.EngineServiceStub(server.channel)
    server.close()


@pytest.fixture
def fresh_stub(llama):
    """An engine of its own: no other test's pins."""
    server = serve(llama)
    yield engine_pb2_grpc.EngineServiceStub(server.channel)
    server.close()


def fresh_prompt() -> list[int]:
    return [_rng.randrange(3, 150) for _ in range(24)]


def run(
    stub, rid: str, ids: list[int], pin_ttl_seconds: float = 0.0, **owner
) -> engine_pb2.RequestOutput:
    """Generate 3 tokens greedily; the last output. `owner`: pin_owner, pin_owner_max_bytes."""
    request = engine_pb2.GenerateRequest(
        add=engine_pb2.EngineRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=3, ignore_eos=True
            ),
            pin_ttl_seconds=pin_ttl_seconds,
            **owner,
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


def test_pins_are_bounded_per_owner_and_pinning_again_adds_nothing(fresh_stub):
    """Each owner may pin 6 blocks: key-a's 6-block prompt and key-b's 4-block one are pinned
    whole; key-a's second prompt is clipped, key-b's 2-block one (its prompt pinned a second
    time in between counting once) is not. After a flood, what was pinned is a hit."""
    # float32 K and V of the tiny Llama's 2 layers, 2 KV heads of 16 dimensions.
    block_bytes = 2 * 2 * 2 * 16 * BLOCK * 4
    a = dict(pin_owner="key-a", pin_owner_max_bytes=6 * block_bytes)
    b = dict(pin_owner="key-b", pin_owner_max_bytes=6 * block_bytes)
    a_first, a_second = fresh_prompt(), fresh_prompt()
    b_first, b_second = fresh_prompt()[:16], fresh_prompt()[:8]
    for rid, ids, owner in (
        ("a1", a_first, a),
        ("a2", a_second, a),
        ("b1", b_first, b),
        ("b1 again", b_first, b),
        ("b2", b_second, b),
    ):
        assert not run(fresh_stub, rid, ids, pin_ttl_seconds=600, **owner).HasField("error")
    for i in range(4):
        run(fresh_stub, f"flood{i}", fresh_prompt())
    assert run(fresh_stub, "a1 back", [*a_first, 5]).usage.cached_tokens == 24
    assert run(fresh_stub, "a2 back", [*a_second, 5]).usage.cached_tokens == 0
    assert run(fresh_stub, "b1 back", [*b_first, 5]).usage.cached_tokens == 16
    assert run(fresh_stub, "b2 back", [*b_second, 5]).usage.cached_tokens == 8
