"""The engine service's LoRA calls over real gRPC on loopback (a tiny random Llama, adapters
made with peft): LoadLoraAdapter from inside --lora-root (INVALID_ARGUMENT naming the rule or
the adapter's problem otherwise), ListLoraAdapters, EngineRequest.lora_name picking the adapter
(transformers + peft's greedy tokens; an unknown name fails the request naming it), and
UnloadLoraAdapter (NOT_FOUND for a name not served); the KV events name the adapter of the blocks
they announce (as a snapshot's do). An unload under traffic is
tests/gateway/test_lora_api.py's and tests/unit/engine/test_lora.py's."""

from __future__ import annotations

import grpc
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc

from common.config import EngineConfig
from grpc_helpers import TIMEOUT, ServerThread
from lora_adapters import make_adapter
from services.engine.server import EngineService
from tiny_models import VARIANTS, hf_greedy, make_checkpoint

PROMPT = [5, 17, 33, 2, 90, 41, 7]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-root")
    base = tmp_path_factory.mktemp("llama")
    config_class, kwargs = VARIANTS["llama"]
    make_checkpoint(base, config_class, dict(kwargs, max_position_embeddings=4096))
    oracle = make_adapter(base, root / "a8", rank=8, alpha=16, seed=3)
    config = EngineConfig(
        model=str(base), dtype="float32", num_kv_blocks=512, lora_root=str(root), max_lora_rank=8
    )
    server = ServerThread(EngineService(config, "127.0.0.1", 0))
    yield engine_pb2_grpc.EngineServiceStub(server.channel), oracle
    server.close()


def request(request_id: str, lora_name: str, max_tokens: int) -> engine_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine_pb2.GenerateRequest(
        add=engine_pb2.EngineRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT,
            sampling_params=params,
            lora_name=lora_name,
        )
    )


def listed(stub) -> dict[str, bool]:
    answer = stub.ListLoraAdapters(engine_pb2.ListLoraAdaptersRequest(), timeout=TIMEOUT)
    return {a.name: a.resident for a in answer.adapters}


def test_load_generate_unload(served):
    stub, oracle = served
    with pytest.raises(grpc.RpcError) as refused:
        stub.LoadLoraAdapter(
            engine_pb2.LoadLoraAdapterRequest(lora_name="x", lora_path="/etc"), timeout=TIMEOUT
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inside the server's --lora-root" in refused.value.details()
    stub.LoadLoraAdapter(
        engine_pb2.LoadLoraAdapterRequest(lora_name="a", lora_path="a8"), timeout=TIMEOUT
    )
    assert listed(stub) == {"a": False}
    (unknown,) = [
        out
        for response in stub.Generate(iter([request("u", "nope", 2)]), timeout=TIMEOUT)
        for out in response.outputs
    ]
    assert unknown.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "'nope' does not exist" in unknown.error.message
    tokens = [
        t
        for response in stub.Generate(iter([request("g", "a", 6)]), timeout=TIMEOUT)
        for out in response.outputs
        for t in out.token_ids
    ]
    assert tokens == hf_greedy(oracle, PROMPT, 6)
    assert listed(stub) == {"a": True}
    stub.UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name="a"), timeout=TIMEOUT)
    assert listed(stub) == {}
    with pytest.raises(grpc.RpcError) as gone:
        stub.UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name="a"), timeout=TIMEOUT)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_kv_events_name_the_adapter(served):
    """The blocks a request of an adapter caches are announced with its name (vLLM's
    lora_name), those of the base model with none."""
    stub, _ = served
    stub.LoadLoraAdapter(
        engine_pb2.LoadLoraAdapterRequest(lora_name="kv", lora_path="a8"), timeout=TIMEOUT
    )
    long_prompt = list(range(3, 3 + 40))  # two full blocks of 16 at least
    for request_id, lora in (("kv-lora", "kv"), ("kv-base", "")):
        message = request(request_id, lora, 1)
        message.add.prompt_token_ids[:] = [*long_prompt[:-1], 60 + len(lora)]
        for _ in stub.Generate(iter([message]), timeout=TIMEOUT):
            pass
    call = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT)
    names: list[str] = []
    for batch in call:
        names += [e.block_stored.lora_name for e in batch.events if e.HasField("block_stored")]
        if len(set(names)) == 2:
            break
    call.cancel()
    assert set(names) == {"kv", ""}
    # Another epoch's subscriber gets a snapshot at once: its runs keep the names apart.
    call = stub.SubscribeKvEvents(
        engine_pb2.SubscribeKvEventsRequest(epoch="another"), timeout=TIMEOUT
    )
    snapshot = next(call)
    call.cancel()
    assert snapshot.snapshot
    stored = [e.block_stored for e in snapshot.events if e.HasField("block_stored")]
    assert {s.lora_name for s in stored} == {"kv", ""}
    stub.UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name="kv"), timeout=TIMEOUT)
