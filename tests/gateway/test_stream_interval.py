"""--stream-interval through the whole served path: a gateway over an engine service whose
requests gather 3 tokens a message streams the same text, logprobs, finish reason and usage as
one that sends every step's token, in fewer chunks; a stop string that falls inside a gathered
burst ends the text where it ends token by token. Real tokenizer and engine services on a tiny
random-weight model with SmolLM2's tokenizer, the real openai client."""

from __future__ import annotations

import openai
import pytest

from common.config import EngineConfig
from gateway_helpers import ENGINE_ARGS, GatewayThread
from grpc_helpers import ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import make_tiny_smollm2

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def clients(tmp_path_factory, default_model_dir):
    """An openai client per stream interval (1 and 3), each stack its own engine."""
    model_dir = make_tiny_smollm2(tmp_path_factory.mktemp("tiny-interval"), default_model_dir)
    tokenizer = ServerThread(TokenizerService(str(model_dir), "127.0.0.1", 0))
    stacks = {}
    for interval in (1, 3):
        engine = ServerThread(
            EngineService(
                EngineConfig(
                    model=str(model_dir),
                    **dict(ENGINE_ARGS, dtype="float32"),
                    stream_interval=interval,
                ),
                "127.0.0.1",
                0,
            )
        )
        gateway = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
        stacks[interval] = (engine, gateway)
    yield {
        interval: openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        for interval, (_, gateway) in stacks.items()
    }
    for engine, gateway in stacks.values():
        gateway.close()
        engine.close()
    tokenizer.close()


def stream(client: openai.OpenAI, **kwargs) -> tuple[list[str], list[float], str, object]:
    """Each chunk's text, every token logprob, the finish reason and the usage."""
    texts, logprobs, finish, usage = [], [], None, None
    for chunk in client.completions.create(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.0,
        **kwargs,
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.text)
            if choice.logprobs is not None:
                logprobs += choice.logprobs.token_logprobs or []
            finish = choice.finish_reason or finish
    return texts, logprobs, finish, usage


def test_gathered_tokens_stream_the_same_answer_in_fewer_chunks(clients):
    every, gathered = (
        stream(clients[i], max_tokens=13, logprobs=1, extra_body={"ignore_eos": True})
        for i in (1, 3)
    )
    assert "".join(gathered[0]) == "".join(every[0])
    assert gathered[1] == pytest.approx(every[1], abs=1e-5) and len(every[1]) == 13
    assert gathered[2] == every[2] == "length"
    assert gathered[3].completion_tokens == every[3].completion_tokens == 13
    # 13 tokens: the first alone, then four bursts of 3 (plus the closing chunks alike).
    assert len(every[0]) - len(gathered[0]) == 13 - 5


def test_a_stop_string_inside_a_burst_ends_where_it_ends_token_by_token(clients):
    text = "".join(stream(clients[1], max_tokens=13, extra_body={"ignore_eos": True})[0])
    # A stop string from the middle of the answer: it completes inside a gathered burst.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    every, gathered = (
        stream(clients[i], max_tokens=13, stop=[stop], extra_body={"ignore_eos": True})
        for i in (1, 3)
    )
    assert "".join(gathered[0]) == "".join(every[0]) == text[: text.index(stop)]
    assert gathered[2] == every[2] == "stop"
    assert gathered[3].completion_tokens == every[3].completion_tokens
