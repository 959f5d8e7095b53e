"""Structured output end to end, with the default model behind the real gateway and services:
seeded samples at temperature 1 against a nested JSON schema all parse and validate
(response_format), regex and choice outputs match (structured_outputs, guided_*), json_object
parses, bad constraints are a 400 naming their parameter, and the gRPC contracts (the engine's
Generate and the gateway's GatewayService) carry the constraint."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, gateway_pb2, gateway_pb2_grpc

from gateway_helpers import check_error
from grpc_helpers import TIMEOUT
from structured_schemas import Person

PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True},
}
MODEL = "SmolLM2-135M-Instruct"
DESCRIBE = [{"role": "user", "content": "Describe a person as JSON."}]
YEAR = r"(19|20)[0-9]{2}"


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    )


def test_seeded_json_schema_samples_all_parse_and_validate(client):
    def ten_samples(seed: int):
        # A generous deadline: twenty sequences of ~30 tokens on a loaded CPU.
        return client.with_options(timeout=4 * TIMEOUT).chat.completions.create(
            model=MODEL,
            messages=DESCRIBE,
            response_format=PERSON_FORMAT,
            n=10,
            seed=seed,
            temperature=1.0,
            max_tokens=60,
        )

    # Two requests of ten at once: twenty samples in the engine side by side.
    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(ten_samples, (1, 2)))
    texts = [choice.message.content for r in responses for choice in r.choices]
    assert len(set(texts)) > 10  # seeded sampling at temperature 1, not one answer
    for response in responses:
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice.message.content
            Person.model_validate(json.loads(choice.message.content))


def test_regex_choice_and_json_object_outputs_match(client):
    year = client.completions.create(
        model=MODEL,
        prompt="The first man walked on the moon in the year",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": YEAR}},
    )
    assert re.fullmatch(YEAR, year.choices[0].text) and year.choices[0].finish_reason == "stop"

    choices = ["yes", "no", "maybe"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sea salty?"}],
            max_tokens=8,
            temperature=1.0,
            seed=3,
            n=3,
            extra_body=extra,
        )
        assert all(c.message.content in choices for c in answer.choices)

    obj = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": 'Reply with a JSON object whose key "answer" is 42.'}
        ],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)

    # Streamed, the deltas add up to a matching text too.
    stream = client.completions.create(
        model=MODEL,
        prompt="The first man walked on the moon in the year",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"guided_regex": YEAR},
    )
    assert (
        "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == year.choices[0].text
    )


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}


@pytest.mark.parametrize(
    "route, fields, param",
    [
        ("/v1/chat/completions", {"response_format": BAD_SCHEMA}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
        ),
        ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
        ("/v1/chat/completions", {"guided_json": {"type": "nonsense"}}, "guided_json"),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"json_object": True}, "guided_regex": "a"},
            "guided_regex",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_parameter(gateway, route, fields, param):
    body = {"max_tokens": 4, **fields}
    body.update({"messages": DESCRIBE} if "chat" in route else {"prompt": "Hi"})
    check_error(httpx.post(gateway.url + route, json=body, timeout=TIMEOUT), 400, param)


def test_the_openai_client_sees_a_bad_schema_as_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="response_format has an invalid JSON schema"):
        client.chat.completions.create(
            model=MODEL, messages=DESCRIBE, max_tokens=4, response_format=BAD_SCHEMA
        )


def test_the_engine_grpc_contract_carries_the_constraint(engine_stub, tokenizer):
    def generate(request_id: str, constraint: common_pb2.StructuredOutput):
        request = engine_pb2.GenerateRequest(
            add=engine_pb2.EngineRequest(
                request_id=f"{request_id}-{time.monotonic_ns()}",
                prompt_token_ids=tokenizer.encode("The first man walked on the moon in the year"),
                sampling_params=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=8, structured_output=constraint
                ),
            )
        )
        outputs = [
            out
            for response in engine_stub.Generate(iter([request]), timeout=TIMEOUT)
            for out in response.outputs
        ]
        return [t for out in outputs for t in out.token_ids], outputs[-1]

    tokens, last = generate("regex", common_pb2.StructuredOutput(regex=YEAR))
    assert re.fullmatch(YEAR, tokenizer.decode(tokens))
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    tokens, _ = generate(
        "choice",
        common_pb2.StructuredOutput(
            choice=common_pb2.StructuredOutput.Choices(choices=["red", "green"])
        ),
    )
    assert tokenizer.decode(tokens) in ("red", "green")
    _, last = generate("bad", common_pb2.StructuredOutput(regex="a(b"))
    assert last.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "structured_output" in last.error.message
    assert last.error.param == ""
    # A constraint labelled with the field it came in: the engine's refusal names that field.
    _, last = generate("labelled", common_pb2.StructuredOutput(regex="a(b", source="guided_regex"))
    assert last.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert last.error.message.startswith("guided_regex has an invalid regular expression")
    assert last.error.param == "guided_regex"


def test_the_gateway_grpc_api_carries_the_constraint(gateway):
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway.grpc_channel)
    params = common_pb2.SamplingParams(
        temperature=0.0, max_tokens=8, structured_output=common_pb2.StructuredOutput(regex=YEAR)
    )
    responses = list(
        stub.Generate(
            gateway_pb2.GatewayServiceGenerateRequest(
                prompt="The first man walked on the moon in the year", sampling_params=params
            ),
            timeout=TIMEOUT,
        )
    )
    assert re.fullmatch(YEAR, "".join(r.text for r in responses))
    params.structured_output.json = '{"type": "nonsense"}'
    with pytest.raises(grpc.RpcError) as error:
        list(
            stub.Generate(
                gateway_pb2.GatewayServiceGenerateRequest(prompt="Hi", sampling_params=params),
                timeout=TIMEOUT,
            )
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output has an invalid JSON schema" in error.value.details()
