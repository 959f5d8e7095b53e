"""Tool calling end to end with the official openai client, the default model (SmolLM2, whose
chat template knows no tools: the generic format) behind the real gateway and services: forced
and named calls at temperature 1 all parse and validate against their tools' schemas, parallel
calls, a full round trip, streamed calls equal to whole ones, max_tokens cutting a call off,
and the 400s (a schema that does not compile, an unknown role, a tool message without its id)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from gateway_helpers import check_error
from grpc_helpers import TIMEOUT

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(max_length=6)
    unit: str = Field(pattern=r"^(celsius|fahrenheit)$")


class Clock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    timezone: str = Field(pattern=r"^[A-Z][a-z]{1,5}/[A-Z][a-z]{1,5}$")
    hours: int = Field(ge=0, le=23)


ARGUMENTS = {"get_weather": Weather, "get_time": Clock}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {
                    "timezone": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}/[A-Z][a-z]{1,5}$"},
                    "hours": {"type": "integer", "minimum": 0, "maximum": 23},
                },
                "required": ["timezone", "hours"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=4 * TIMEOUT
    )


def check_call(call) -> None:
    """A call of one of TOOLS whose arguments satisfy its schema."""
    assert call.type == "function" and call.id.startswith("call_")
    ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)


def test_forced_and_named_calls_all_parse_and_validate(client):
    def sample(choice, seed):
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            n=10,
            seed=seed,
            temperature=1.0,
            max_tokens=60,
        )

    named = {"type": "function", "function": {"name": "get_time"}}
    # Twenty samples side by side in the engine: ten of any tool, ten of the named one.
    with ThreadPoolExecutor(2) as pool:
        required, forced = pool.map(sample, ("required", named), (1, 2))
    arguments = set()
    for response, names in ((required, {"get_weather", "get_time"}), (forced, {"get_time"})):
        assert len(response.choices) == 10
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls", choice.message
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.function.name in names
            check_call(call)
            arguments.add(call.function.arguments)
    assert len(arguments) > 10  # seeded sampling at temperature 1, not one answer


def test_parallel_calls(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS[:1],
        tool_choice="required",
        n=3,
        seed=5,
        temperature=1.0,
        max_tokens=90,
    )
    counts = []
    for choice in response.choices:
        calls = choice.message.tool_calls
        # One call after another may run into max_tokens: the last one is then cut off.
        assert choice.finish_reason in ("tool_calls", "length"), choice.message
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        for call in complete:
            check_call(call)
        ids = [call.id for call in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)
        counts.append(len(ids))
    # Parallel calls allowed: some answers make several.
    assert max(counts) > 1, counts


def test_tool_round_trip(client, gateway):
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        seed=7,
        temperature=1.0,
        max_tokens=60,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    result = json.dumps({"temperature": 21, "sky": "clear"})
    conversation = [
        *ASK,
        message,  # the assistant's turn, sent back as the client received it
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        tools=TOOLS,
        tool_choice="none",
        seed=7,
        temperature=0.0,
        max_tokens=20,
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.content
    assert second.choices[0].message.tool_calls is None
    # The call and its result are in the prompt the model read.
    prompt = httpx.post(
        gateway.url + "/tokenize",
        json={"messages": [*ASK, {"role": "user", "content": "x"}]},
        timeout=TIMEOUT,
    ).json()
    assert second.usage.prompt_tokens > prompt["count"] + 20


def test_auto_answers_or_calls_validly(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        n=3,
        seed=11,
        temperature=1.0,
        max_tokens=40,
    )
    for choice in response.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            if choice.finish_reason == "tool_calls":
                for call in choice.message.tool_calls:
                    check_call(call)
        else:
            assert "<tool_call>" not in choice.message.content


def test_streamed_calls_equal_whole_ones(client):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=3,
        temperature=1.0,
        max_tokens=60,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    pieces = 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # the first delta of a call: its id and name
                    assert delta.id and delta.function.name and delta.type == "function"
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:  # later ones: pieces of the arguments only
                    assert delta.id is None and delta.function.name is None
                    pieces += 1
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]
    assert pieces > 1  # the arguments streamed, not in one piece


def test_max_tokens_cutting_a_call_is_length(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8
    )
    assert response.choices[0].finish_reason == "length"


def post(gateway, body: dict) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)


def test_a_schema_that_does_not_compile_names_its_tool(gateway):
    bad = {
        "type": "function",
        "function": {
            "name": "bad",
            "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}},
        },
    }
    for choice in ("required", "auto"):
        body = {"messages": ASK, "tools": [*TOOLS, bad], "tool_choice": choice, "max_tokens": 5}
        error = check_error(post(gateway, body), 400, "tools[2]")
        assert "strin" in error["message"]
    named = {"type": "function", "function": {"name": "bad"}}
    body = {"messages": ASK, "tools": [bad], "tool_choice": named, "max_tokens": 5}
    check_error(post(gateway, body), 400, "tools[0]")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "wizard"),
        (
            {"messages": [*ASK, {"role": "tool", "content": "21"}]},
            "messages",
            "tool_call_id",
        ),
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
            "nope",
        ),
        ({"messages": ASK, "tools": [TOOLS[0], TOOLS[0]]}, "tools[1]", "twice"),
        ({"messages": ASK, "functions": [TOOLS[0]["function"]]}, "functions", "not supported"),
    ],
)
def test_bad_tool_requests_are_400s(gateway, body, param, words):
    error = check_error(post(gateway, {"max_tokens": 5, **body}), 400, param)
    assert words in error["message"]


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "function"])
def test_openai_roles_are_accepted(gateway, role):
    message = {"role": role, "content": "hi", **({"name": "f"} if role == "function" else {})}
    response = post(gateway, {"messages": [message, *ASK], "max_tokens": 1})
    assert response.status_code == 200, response.text
