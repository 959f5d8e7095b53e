"""Bad requests get a clear 4xx with the OpenAI error body naming the parameter, never a 500,
and leave nothing running in the engine."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway_helpers import MAX_MODEL_LEN, check_error, engine_stats
from grpc_helpers import TIMEOUT

CHAT = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> dict:
    return {"messages": CHAT, "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"prompt": "Hi", "max_tokens": 4, **fields}


CASES = [
    # (route, body, status, param)
    ("/v1/chat/completions", chat(temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", chat(top_p=0), 400, "top_p"),
    ("/v1/chat/completions", chat(n=-1), 400, "n"),
    ("/v1/chat/completions", chat(n=0), 400, "n"),
    ("/v1/chat/completions", chat(max_tokens=-5), 400, "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("/v1/chat/completions", chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("/v1/chat/completions", chat(top_logprobs=50, logprobs=True), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(temperature="hot"), 400, "temperature"),
    ("/v1/chat/completions", chat(stop=[""]), 400, "stop"),
    ("/v1/chat/completions", chat(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("/v1/chat/completions", chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"5": -101}), 400, "logit_bias"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "tools"),
    ("/v1/chat/completions", chat(model="gpt-4"), 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("/v1/chat/completions", chat(cache={"pin_prefix": True, "ttl_seconds": 0}), 400, "cache"),
    ("/v1/chat/completions", chat(cache={"pin_prefix": True, "ttl_seconds": 7200}), 400, "cache"),
    ("/v1/chat/completions", chat(cache={"pin_prefix": "yes"}), 400, "cache"),
    ("/v1/chat/completions", chat(cache={"pin": True}), 400, "cache"),
    ("/v1/completions", completion(prompt=[]), 400, "prompt"),
    ("/v1/completions", completion(prompt=""), 400, "prompt"),
    ("/v1/completions", completion(prompt=[1, "a"]), 400, "prompt"),
    ("/v1/completions", completion(prompt=[[1, 2], [10**9]]), 400, "prompt"),
    ("/v1/completions", completion(prompt=[5] * MAX_MODEL_LEN), 400, "prompt"),
    ("/v1/completions", completion(prompt=[5] * 1000, max_tokens=100), 400, "max_tokens"),
    ("/v1/completions", completion(logprobs=21), 400, "logprobs"),
    ("/v1/completions", completion(seed=1.5), 400, "seed"),
    ("/v1/completions", completion(seed=2**70), 400, "seed"),
    ("/v1/completions", completion(top_k=2**40), 400, "top_k"),
    ("/v1/completions", completion(max_tokens=0), 400, "max_tokens"),  # 0 only with echo
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as client:
        yield client


@pytest.mark.parametrize(("route", "body", "status", "param"), CASES)
def test_bad_requests_name_the_parameter(http, engine_stub, route, body, status, param):
    check_error(http.post(route, json=body), status, param)
    assert engine_stats(engine_stub).num_running == 0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_bad_bodies(http, route):
    headers = {"content-type": "application/json"}
    check_error(http.post(route, content=b"{not json", headers=headers), 400, None)
    check_error(http.post(route, content=b"[1, 2]", headers=headers), 400, None)
    check_error(http.post(route, content=b"", headers=headers), 400, None)
    # JSON has no NaN or Infinity; Python's parser would take them.
    nan = b'{"prompt": "Hi", "messages": [], "temperature": NaN}'
    assert (
        check_error(http.post(route, content=nan, headers=headers), 400, "temperature")["type"]
        == "invalid_request_error"
    )
    check_error(
        http.post(route, content=b'{"prompt": "Hi"}', headers={"content-type": "text/plain"}),
        415,
        None,
    )
    assert http.get(route).status_code == 405


def test_unknown_routes_are_404(http):
    error = http.get("/v1/nothing").json()["error"]
    assert "/v1/nothing" in error["message"]


def test_the_openai_client_sees_typed_errors(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
