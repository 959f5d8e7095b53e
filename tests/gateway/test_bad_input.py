"""Bad input at the level of the bytes and the numbers: bodies that are not JSON, not UTF-8,
too large or sent as another content type; unknown fields; token ids outside the vocabulary;
NaN and infinite numbers; negative and huge counts. Each gets its 4xx with the OpenAI error
body, and the message names the problem (the parameter, or what is wrong with the body).

test_errors.py holds the parameter-range cases; these are the ones a fuzzer or a careless
client sends, checked for the message too."""

from __future__ import annotations

import httpx
import pytest

from common.config import MAX_REQUEST_BODY_BYTES
from gateway_helpers import check_error, engine_stats
from grpc_helpers import TIMEOUT

CHAT = b'"messages": [{"role": "user", "content": "Hi"}]'
JSON = {"content-type": "application/json"}
VOCAB = 49152  # the default model's


def chat(fields: bytes) -> bytes:
    return b"{" + CHAT + b", " + fields + b"}"


def completion(fields: bytes) -> bytes:
    return b'{"prompt": "Hi", "max_tokens": 2, ' + fields + b"}"


CASES = [
    # (id, route, body, status, param, words the message must hold)
    (
        "truncated-json",
        "/v1/completions",
        b'{"prompt": "Hi", "max_tokens": 2',
        400,
        None,
        ["not valid JSON"],
    ),
    (
        "trailing-garbage",
        "/v1/chat/completions",
        chat(b'"n": 1') + b"}",
        400,
        None,
        ["not valid JSON"],
    ),
    (
        "invalid-utf8-in-string",
        "/v1/completions",
        b'{"prompt": "Hi \xff\xfe"}',
        400,
        None,
        ["UTF-8", "0xff"],
    ),
    ("truncated-utf8-character", "/tokenize", b'{"prompt": "caf\xc3"}', 400, None, ["UTF-8"]),
    (
        "lone-continuation-byte",
        "/v1/chat/completions",
        chat(b'"user": "\x80"'),
        400,
        None,
        ["UTF-8", "0x80"],
    ),
    (
        "unknown-field",
        "/v1/completions",
        completion(b'"frobnicate": true'),
        400,
        "frobnicate",
        ["unrecognized"],
    ),
    (
        "misspelt-field",
        "/v1/chat/completions",
        chat(b'"max_token": 5'),
        400,
        "max_token",
        ["unrecognized"],
    ),
    ("unknown-fields", "/tokenize", b'{"prompt": "a", "x": 1, "y": 2}', 400, "x", ["x, y"]),
    (
        "oov-prompt-id",
        "/v1/completions",
        f'{{"prompt": [1, {VOCAB}]}}'.encode(),
        400,
        "prompt",
        [str(VOCAB), "vocabulary"],
    ),
    (
        "negative-prompt-id",
        "/v1/completions",
        b'{"prompt": [[1], [-7]]}',
        400,
        "prompt",
        ["-7", "vocabulary"],
    ),
    (
        "oov-detokenize-id",
        "/detokenize",
        f'{{"tokens": [{VOCAB}]}}'.encode(),
        400,
        "tokens",
        [str(VOCAB), "vocabulary"],
    ),
    (
        "beyond-int32-detokenize-id",
        "/detokenize",
        b'{"tokens": [1099511627776]}',
        400,
        "tokens",
        ["1099511627776", "vocabulary"],
    ),
    (
        "oov-logit-bias",
        "/v1/completions",
        completion(b'"logit_bias": {"999999": 5}'),
        400,
        "logit_bias",
        ["999999"],
    ),
    (
        "logit-bias-past-openais-range",
        "/v1/completions",
        completion(b'"logit_bias": {"5": 1e308}'),
        400,
        "logit_bias",
        ["-100, 100", "1e+308"],
    ),
    (
        "vanishing-repetition-penalty",
        "/v1/completions",
        completion(b'"repetition_penalty": 1e-300'),
        400,
        "repetition_penalty",
        ["1e-05", "1e-300"],
    ),
    ("nan", "/v1/completions", completion(b'"top_p": NaN'), 400, "top_p", ["finite"]),
    (
        "infinity",
        "/v1/chat/completions",
        chat(b'"temperature": Infinity'),
        400,
        "temperature",
        ["finite"],
    ),
    (
        "minus-infinity",
        "/v1/completions",
        completion(b'"presence_penalty": -Infinity'),
        400,
        "presence_penalty",
        ["finite"],
    ),
    (
        "overflowing-number",
        "/v1/completions",
        completion(b'"frequency_penalty": 1e999'),
        400,
        "frequency_penalty",
        ["finite"],
    ),
    (
        "nan-in-a-map",
        "/v1/chat/completions",
        chat(b'"logit_bias": {"5": NaN}'),
        400,
        "logit_bias",
        ["finite"],
    ),
    ("huge-n", "/v1/chat/completions", chat(b'"n": 1000000'), 400, "n", ["64"]),
    ("beyond-int64-n", "/v1/completions", completion(b'"n": 18446744073709551617'), 400, "n", []),
    (
        "negative-max-tokens",
        "/v1/completions",
        b'{"prompt": "Hi", "max_tokens": -1}',
        400,
        "max_tokens",
        ["greater than"],
    ),
    (
        "huge-max-tokens",
        "/v1/completions",
        b'{"prompt": "Hi", "max_tokens": 10000000000000}',
        400,
        "max_tokens",
        ["10000000000000", "context length"],
    ),
    (
        "beyond-int64-max-tokens",
        "/v1/chat/completions",
        chat(b'"max_tokens": 100000000000000000000000'),
        400,
        "max_tokens",
        ["context length"],
    ),
    (
        "huge-max-completion-tokens",
        "/v1/chat/completions",
        chat(b'"max_completion_tokens": 4294967296'),
        400,
        "max_completion_tokens",
        ["context length"],
    ),
    (
        "huge-min-tokens",
        "/v1/completions",
        completion(b'"min_tokens": 4294967296'),
        400,
        "min_tokens",
        [],
    ),
    (
        "negative-top-logprobs",
        "/v1/chat/completions",
        chat(b'"logprobs": true, "top_logprobs": -1'),
        400,
        "top_logprobs",
        ["0"],
    ),
    (
        "huge-top-logprobs",
        "/v1/chat/completions",
        chat(b'"logprobs": true, "top_logprobs": 100000000000000000000'),
        400,
        "top_logprobs",
        ["20"],
    ),
    ("negative-logprobs", "/v1/completions", completion(b'"logprobs": -3'), 400, "logprobs", ["0"]),
    (
        "empty-allowed-token-ids",
        "/v1/completions",
        completion(b'"allowed_token_ids": []'),
        400,
        "allowed_token_ids",
        [],
    ),
    (
        "allowed-token-id-outside-the-vocabulary",
        "/v1/chat/completions",
        chat(b'"allowed_token_ids": [5, 10000000]'),
        400,
        "allowed_token_ids",
        ["10000000", "vocabulary"],
    ),
    ("blank-bad-word", "/v1/completions", completion(b'"bad_words": ["  "]'), 400, "bad_words", []),
    ("empty-bad-word", "/v1/completions", completion(b'"bad_words": [""]'), 400, "bad_words", []),
    (
        "too-many-bad-words",
        "/v1/completions",
        completion(b'"bad_words": [' + b", ".join([b'"w"'] * 257) + b"]"),
        400,
        "bad_words",
        ["256"],
    ),
    (
        "zero-truncation",
        "/v1/completions",
        completion(b'"truncate_prompt_tokens": 0'),
        400,
        "truncate_prompt_tokens",
        ["-1 or at least 1"],
    ),
    (
        "truncation-over-the-context",
        "/v1/chat/completions",
        chat(b'"truncate_prompt_tokens": 1000000'),
        400,
        "truncate_prompt_tokens",
        ["1000000", "max_model_len"],
    ),
    (
        "huge-logprobs",
        "/v1/completions",
        completion(b'"logprobs": 4294967296'),
        400,
        "logprobs",
        ["20"],
    ),
]


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as client:
        yield client


@pytest.mark.parametrize(
    ("route", "body", "status", "param", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_gets_a_4xx_that_names_the_problem(
    http, engine_stub, route, body, status, param, words
):
    error = check_error(http.post(route, content=body, headers=JSON), status, param)
    for word in words:
        assert word in error["message"], error
    assert engine_stats(engine_stub).num_running == 0


def test_a_body_of_another_content_type_is_415(http):
    # What `curl -d` sends unless told otherwise.
    response = http.post(
        "/v1/completions",
        content=b'{"prompt": "Hi"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    error = check_error(response, 415, None)
    assert "application/json" in error["message"]
    assert "application/x-www-form-urlencoded" in error["message"]


def test_an_oversized_body_is_413_with_or_without_its_length(http, engine_stub):
    oversized = b'{"prompt": "' + b"a" * MAX_REQUEST_BODY_BYTES + b'"}'
    declared = http.post("/v1/completions", content=oversized, headers=JSON)
    assert str(MAX_REQUEST_BODY_BYTES) in check_error(declared, 413, None)["message"]

    def chunked():  # no Content-Length: the limit applies while reading
        for start in range(0, len(oversized), 1 << 16):
            yield oversized[start : start + (1 << 16)]

    streamed = http.post("/v1/completions", content=chunked(), headers=JSON)
    assert str(MAX_REQUEST_BODY_BYTES) in check_error(streamed, 413, None)["message"]
    # A body just under the limit is read (and refused for what it says, not for its size).
    under = b'{"prompt": "Hi", "pad": "' + b"a" * (MAX_REQUEST_BODY_BYTES - 100) + b'"}'
    check_error(http.post("/v1/completions", content=under, headers=JSON), 400, "pad")
    # The server is still well after all of it.
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert engine_stats(engine_stub).num_running == 0
