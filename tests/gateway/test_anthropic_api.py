"""Anthropic's Messages API (/v1/messages) end to end with the official anthropic client and the
default model: a greedy answer equal to the chat completion's, streamed in Anthropic's event
order with the same text, stop reasons (max_tokens, stop_sequence, tool_use), a forced tool use
and its tool_result turn, count_tokens equal to the chat template's prompt length, x-api-key
auth, cache_control mapped onto a pin, and bad input answered in Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from gateway.anthropic import protocol as aapi
from gateway.anthropic import translate
from gateway.openai import protocol as api
from gateway_helpers import MAX_MODEL_LEN, start_gateway
from grpc_helpers import TIMEOUT

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are terse."
ASK = {"role": "user", "content": "Name a colour."}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# This client has no sampling arguments (newer Claude models take none): they go as extra fields.
GREEDY = {"temperature": 0.0}
KEY = "sk-folio-test-anthropic-0123456789"


def anthropic_client(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=4 * TIMEOUT)


@pytest.fixture(scope="module")
def client(gateway) -> anthropic.Anthropic:
    return anthropic_client(gateway.url)


def test_whole_and_streamed_answers_equal_the_chat_completion(gateway, client):
    kwargs = dict(model=MODEL, system=SYSTEM, messages=[ASK], max_tokens=6, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    chat = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused").chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, ASK],
        max_tokens=6,
        temperature=0.0,
    )
    (block,) = whole.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == MODEL
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert whole.stop_reason == expected and whole.stop_sequence is None

    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    # The client adds its own "text" event after each text delta.
    raw = [t for t in types if t != "text"]
    deltas = raw.count("content_block_delta")
    assert deltas >= 1
    assert raw == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == block.text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens

    # On the wire (the client drops pings): each event named as its data's type, a ping second.
    body = {"system": SYSTEM, "messages": [ASK], "max_tokens": 6, "stream": True, **GREEDY}
    lines = httpx.post(gateway.url + "/v1/messages", json=body, timeout=TIMEOUT).text.split("\n")
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data:")]
    assert names == [data["type"] for data in datas]
    assert names[:2] == ["message_start", "ping"] and names[2:] == raw[1:]
    assert datas[-2]["delta"]["stop_reason"] == whole.stop_reason


def test_either_service_tier_runs_as_the_standard_one(client):
    for tier in ("auto", "standard_only"):
        message = client.messages.create(
            model=MODEL, messages=[ASK], max_tokens=2, service_tier=tier, extra_body=GREEDY
        )
        assert message.usage.output_tokens == 2 or message.stop_reason == "end_turn"


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    kwargs = dict(model=MODEL, messages=[ASK], max_tokens=6, extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    stop = text.strip()[1:3]
    assert len(stop) == 2
    stopped = client.messages.create(**kwargs, stop_sequences=[stop])
    assert stopped.content[0].text == text[: text.index(stop)]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == stopped.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_tool_use_round_trip(client):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    kwargs = dict(
        model=MODEL,
        messages=[ask],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=40,
        extra_body=GREEDY,
    )
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    call = whole.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert set(call.input) == {"city"}

    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert starts[-1].content_block.type == "tool_use"
    assert starts[-1].content_block.name == "get_weather"
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert pieces and final.content[-1].input == call.input
    assert final.stop_reason == "tool_use"

    turn = [
        ask,
        {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}],
        },
    ]
    answer = client.messages.create(
        model=MODEL, messages=turn, tools=[WEATHER], max_tokens=3, extra_body=GREEDY
    )
    assert answer.content and answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # The call and its result are in what the model read, as count_tokens counts it.
    counted = client.messages.count_tokens(model=MODEL, messages=turn, tools=[WEATHER])
    assert answer.usage.input_tokens == counted.input_tokens
    asked = client.messages.count_tokens(model=MODEL, messages=[ask], tools=[WEATHER])
    assert counted.input_tokens > asked.input_tokens + 10


def test_a_final_assistant_message_is_continued(gateway, client):
    """Anthropic's prefill: the answer continues the assistant's text, as a completion of the
    conversation cut after that text does."""
    started = [ASK, {"role": "assistant", "content": "My favourite colour is"}]
    message = client.messages.create(model=MODEL, messages=started, max_tokens=6, extra_body=GREEDY)
    tokens = httpx.post(
        gateway.url + "/tokenize",
        json={"messages": started, "add_generation_prompt": False, "continue_final_message": True},
        timeout=TIMEOUT,
    ).json()["tokens"]
    text = httpx.post(gateway.url + "/detokenize", json={"tokens": tokens}, timeout=TIMEOUT)
    assert text.json()["prompt"].endswith("<|im_start|>assistant\nMy favourite colour is")
    completion = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused").completions.create(
        model=MODEL, prompt=tokens, max_tokens=6, temperature=0.0
    )
    assert message.content[0].text == completion.choices[0].text
    assert message.usage.input_tokens == len(tokens)
    assert client.messages.count_tokens(model=MODEL, messages=started).input_tokens == len(tokens)


def test_the_models_list_in_anthropics_shape(gateway, client):
    (listed,) = client.models.list().data
    assert (listed.id, listed.type, listed.display_name) == (MODEL, "model", MODEL)
    assert listed.max_input_tokens == MAX_MODEL_LEN and listed.created_at.year >= 2025
    assert client.models.retrieve(MODEL) == listed
    # OpenAI's clients (no anthropic-version) get OpenAI's shape from the same routes.
    openai_shape = httpx.get(gateway.url + "/v1/models", timeout=TIMEOUT).json()
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "model"
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("claude-nothing")


def test_count_tokens_is_the_chat_templates_prompt_length(gateway, client):
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[ASK])
    tokenized = httpx.post(
        gateway.url + "/tokenize",
        json={"messages": [{"role": "system", "content": SYSTEM}, ASK]},
        timeout=TIMEOUT,
    ).json()
    assert counted.input_tokens == tokenized["count"] > 5


def test_x_api_key_is_the_api_key(services):
    server = start_gateway(services, api_keys=(KEY,))
    try:
        counted = anthropic_client(server.url, KEY).messages.count_tokens(
            model=MODEL, messages=[ASK]
        )
        assert counted.input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic_client(server.url, "sk-wrong").messages.count_tokens(
                model=MODEL, messages=[ASK]
            )
        assert refused.value.status_code == 401
        assert refused.value.body["error"]["type"] == "authentication_error"
    finally:
        server.close()


@pytest.mark.parametrize(
    ("body", "status", "kind", "named"),
    [
        ({"messages": [ASK]}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [ASK], "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        (
            {"messages": [ASK], "max_tokens": 2, "thinking": {"type": "enabled"}},
            400,
            "invalid_request_error",
            "thinking",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ],
                "max_tokens": 2,
            },
            400,
            "invalid_request_error",
            "messages[0].content[0]",
        ),
        (
            {"messages": [ASK], "max_tokens": 2, "tool_choice": {"type": "any"}},
            400,
            "invalid_request_error",
            "tool_choice",
        ),
        ({"model": "nope", "messages": [ASK], "max_tokens": 2}, 404, "not_found_error", "nope"),
        (
            {"messages": [ASK], "max_tokens": 2, "service_tier": "priority"},
            400,
            "invalid_request_error",
            "service_tier",
        ),
        (
            {
                "messages": [ASK],
                "max_tokens": 2,
                "tools": [WEATHER | {"cache_control": {"type": "ephemeral", "ttl": "2h"}}],
            },
            400,
            "invalid_request_error",
            "tools[0].cache_control.ttl",
        ),
    ],
)
def test_bad_input_gets_anthropics_error_shape(gateway, body, status, kind, named):
    response = httpx.post(gateway.url + "/v1/messages", json=body, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind and named in error["error"]["message"]


def test_cache_control_pins_the_prompt_and_changes_nothing_in_the_answer(client):
    """Cache breakpoints become the chat request's pin, for the longest TTL asked; the answer
    is the unpinned one's (tests/services/test_kv_pins.py shows a pin keeping the prefix)."""
    hour = {"type": "ephemeral", "ttl": "1h"}
    cached = [{"type": "text", "text": SYSTEM, "cache_control": hour}]
    body = {"messages": [ASK], "max_tokens": 6, "system": cached}
    chat = translate.chat_request(aapi.MessagesRequest.model_validate(body))
    assert chat.cache == api.CacheOptions(pin_prefix=True, ttl_seconds=3600.0)
    body["system"] = SYSTEM
    assert translate.chat_request(aapi.MessagesRequest.model_validate(body)).cache is None
    kwargs = dict(model=MODEL, messages=[ASK], max_tokens=6, extra_body=GREEDY)
    plain = client.messages.create(system=SYSTEM, **kwargs)
    pinned = client.messages.create(system=cached, **kwargs)
    assert pinned.content[0].text == plain.content[0].text


def test_the_client_raises_on_bad_input(client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=MODEL, messages=[ASK], max_tokens=2, extra_body={"temperature": 2.0}
        )
    assert "temperature" in refused.value.body["error"]["message"]


def test_count_tokens_counts_a_prompt_too_long_to_answer(client):
    """count_tokens is how a client learns a conversation no longer fits: it counts one longer
    than the context, where /v1/messages refuses it."""
    long = {"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}
    counted = client.messages.count_tokens(model=MODEL, messages=[long])
    assert counted.input_tokens > MAX_MODEL_LEN
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, messages=[long], max_tokens=1)
