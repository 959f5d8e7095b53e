"""The Responses API (/v1/responses) end to end with the official openai client and the default
model: a text answer equal to the chat completion's, the streamed events in their documented
order with consecutive sequence numbers (through responses.stream), text.format json_schema,
a function call round trip (streamed and whole), and the stateless rules (store false,
previous_response_id refused)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from gateway_helpers import check_error
from grpc_helpers import TIMEOUT

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=8)
    people: int = Field(ge=0, le=999)


CITY_FORMAT = {
    "type": "json_schema",
    "name": "city",
    "schema": City.model_json_schema(),
    "strict": True,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=4 * TIMEOUT
    )


def test_text_answer_equals_the_chat_completion(client):
    response = client.responses.create(
        model=MODEL,
        instructions="You are terse.",
        input="Name a colour.",
        max_output_tokens=12,
        temperature=0.0,
        store=True,
        service_tier="flex",  # the batch lane: on an idle engine, the same answer
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
        ],
        max_tokens=12,
        temperature=0.0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.to_dict()["store"] is False  # accepted, and nothing is stored
    assert response.service_tier == "flex" and chat.service_tier is None
    assert response.instructions == "You are terse." and response.max_output_tokens == 12
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_json_schema_and_streamed_events_in_order(client):
    kwargs = dict(
        model=MODEL,
        input="Describe a city as JSON.",
        text={"format": CITY_FORMAT},
        temperature=1.0,
        max_output_tokens=40,
        extra_body={"seed": 4},
    )
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    City.model_validate_json(whole.output_text)
    assert whole.text.format.type == "json_schema"

    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = types.count("response.output_text.delta")
    assert deltas > 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.id == events[0].response.id


def test_function_call_round_trip(client):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    kwargs = dict(
        model=MODEL,
        input=[ask],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=40,
        extra_body={"seed": 9},
    )
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}

    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(pieces),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(pieces) == events[-3].arguments == final.output[0].arguments == call.arguments

    answer = client.responses.create(
        model=MODEL,
        input=[
            ask,
            call.model_dump(exclude_none=True),  # the call item, sent back as received
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, clear"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0.0,
        max_output_tokens=10,
    )
    assert answer.output_text
    # The call and its output are in what the model read.
    asked = client.responses.create(model=MODEL, input=[ask], max_output_tokens=1)
    assert answer.usage.input_tokens > asked.usage.input_tokens + 20


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "image", "url": "x"}]}, "input"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
    ],
)
def test_bad_responses_requests_are_400s(gateway, body, param):
    response = httpx.post(gateway.url + "/v1/responses", json=body, timeout=TIMEOUT)
    check_error(response, 400, param)
