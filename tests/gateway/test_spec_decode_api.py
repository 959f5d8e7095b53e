"""Speculative decoding through the gateway, with the real openai client: a copy-heavy prompt
with a stop string gives the text and finish_reason it gives without speculation, streamed and
not (a step's several tokens reach the stop-string matcher as one delta), and the usage counts
the drafts in completion_tokens_details. Two stacks on the default model in float32 (a tiny
random model copies nothing, so its drafts are never accepted): one plain, one drafting with
ngram prompt lookup."""

from __future__ import annotations

import json

import openai
import pytest

from common.config import EngineConfig
from gateway_helpers import ENGINE_ARGS, GatewayThread
from grpc_helpers import ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
PROMPT = (
    "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    "
    "return a - b\n\ndef mul(a, b):\n    return a * b\n\nRepeated:\ndef add(a, b):\n"
)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def clients(default_model_dir):
    """openai clients of a gateway before a plain engine and of one before a drafting engine
    (one tokenizer service)."""
    tokenizer = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    engines, gateways = [], []
    for spec in (None, NGRAM):
        config = EngineConfig(
            model=str(default_model_dir),
            **dict(ENGINE_ARGS, dtype="float32", enforce_eager=True),
            speculative_config=spec,
        )
        engines.append(ServerThread(EngineService(config, "127.0.0.1", 0)))
        gateways.append(
            GatewayThread(f"127.0.0.1:{engines[-1].port}", f"127.0.0.1:{tokenizer.port}")
        )
    yield [openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0) for g in gateways]
    for server in (*gateways, *engines, tokenizer):
        server.close()


def complete(client: openai.OpenAI, **params) -> openai.types.Completion:
    model = client.models.list().data[0].id
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, **params
    )


def streamed(client: openai.OpenAI, **params) -> tuple[str, str | None]:
    """The text and finish_reason of a streamed completion."""
    text, reason = "", None
    for chunk in complete(client, stream=True, **params):
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


def test_a_stop_string_ends_the_text_as_without_speculation(clients):
    plain, spec = clients
    full = complete(plain).choices[0].text
    # A stop string whose first occurrence is past the greedy text's first quarter: it ends
    # the text before max_tokens, after several steps of the drafting engine (the text repeats
    # itself, so the stop may not come from its second half).
    stop = next(
        full[start:end]
        for start in range(len(full) // 4, len(full))
        for end in range(start + 3, len(full) + 1)
        if full.find(full[start:end]) == start
    )
    expected = complete(plain, stop=[stop])
    got = complete(spec, stop=[stop])
    assert expected.choices[0].finish_reason == "stop"
    assert len(expected.choices[0].text) < len(full)
    assert got.choices[0].text == expected.choices[0].text
    assert got.choices[0].finish_reason == "stop"
    assert streamed(spec, stop=[stop]) == (expected.choices[0].text, "stop")
    # The drafting engine's usage names its drafts (it drafts from the first decode step: the
    # prompt's last token occurs earlier in it); the plain one's has no details.
    details = got.usage.completion_tokens_details
    assert details is not None
    assert details.accepted_prediction_tokens is not None
    assert details.rejected_prediction_tokens is not None
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    # Tokens a verification step accepted past the stop string are not the request's.
    assert got.usage.completion_tokens == expected.usage.completion_tokens
    assert expected.usage.completion_tokens_details is None
