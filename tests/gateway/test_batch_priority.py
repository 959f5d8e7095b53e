"""Batch lines give way to interactive requests: on an engine with one sequence slot, an
interactive request sent while a long batch line runs is answered whole before that line ends
(it takes the slot at the next step). Were the line not in the engine's batch lane, the request
would wait for the line's last token. OpenAI's flex service tier runs in the same lane. A tiny
random model with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from common.grpc_stubs.folio.v1 import engine_pb2_grpc

from common.config import EngineConfig, GatewayConfig
from gateway_helpers import ENGINE_ARGS, GatewayThread, engine_stats
from grpc_helpers import ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import make_tiny_smollm2

BATCH_TOKENS = 1000
WAIT_SECONDS = 120.0


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory, default_model_dir):
    """A gateway before an engine that runs one sequence at a time."""
    model = make_tiny_smollm2(tmp_path_factory.mktemp("tiny-batch"), default_model_dir)
    tokenizer = ServerThread(TokenizerService(str(model), "127.0.0.1", 0))
    engine_args = dict(ENGINE_ARGS, dtype="float32", max_num_seqs=1)
    engine = ServerThread(
        EngineService(EngineConfig(model=str(model), **engine_args), "127.0.0.1", 0)
    )
    gateway = GatewayThread(
        f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}", GatewayConfig()
    )
    yield gateway, engine_pb2_grpc.EngineServiceStub(engine.channel)
    gateway.close()
    engine.close()
    tokenizer.close()


def gateway_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_an_interactive_request_passes_a_running_batch_line(one_slot):
    gateway, engine = one_slot
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    line = {
        "custom_id": "long",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "Once", "max_tokens": BATCH_TOKENS, "ignore_eos": True},
    }
    file = client.files.create(file=("job.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + WAIT_SECONDS
    while engine_stats(engine).num_running == 0:  # the batch line holds the one slot
        assert time.monotonic() < deadline
        time.sleep(0.01)
    answer = client.completions.create(
        model=gateway_model(client), prompt="Hello", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert answer.usage.completion_tokens == 8
    assert client.batches.retrieve(batch.id).request_counts.completed == 0
    assert client.batches.cancel(batch.id).status == "cancelling"


def test_a_flex_request_gives_way_as_a_batch_line_does(one_slot):
    gateway, _ = one_slot
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    model = gateway_model(client)
    flex = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Once"}],
        max_tokens=BATCH_TOKENS - 100,  # the chat template's tokens come first
        stream=True,
        service_tier="flex",
        extra_body={"ignore_eos": True},
    )
    first = next(iter(flex))  # the flex request holds the one slot
    assert first.service_tier == "flex"
    ended: dict[str, float] = {}

    def read_to_the_end() -> None:
        for _ in flex:
            pass
        ended["flex"] = time.monotonic()

    reader = threading.Thread(target=read_to_the_end)
    reader.start()
    answer = client.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=8,
        extra_body={"ignore_eos": True, "service_tier": "auto"},
    )
    ended["interactive"] = time.monotonic()
    reader.join(WAIT_SECONDS)
    assert answer.usage.completion_tokens == 8 and answer.model_extra["service_tier"] == "default"
    assert ended["interactive"] < ended["flex"]
