"""Failures that are the gateway's own (a bug in it, injected here into the real gateway), not
the client's and not an engine's: the client gets a 500, the server log gets the traceback,
whether the failure comes before the answer or in the middle of a stream."""

from __future__ import annotations

import functools
import json
import logging
import traceback

import httpx
import pytest

from gateway import completions
from gateway.responses import translate
from grpc_helpers import TIMEOUT

BUG = "injected: a bug in the gateway"


def raise_bug(*args: object, exception: type[Exception] = RuntimeError) -> None:
    raise exception(BUG)


def logged_with_traceback(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The error records whose traceback is the injected bug's."""
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR
        and r.exc_info
        and BUG in "".join(traceback.format_exception(*r.exc_info))
    ]


def test_an_internal_value_error_is_a_logged_500_not_the_clients_fault(
    gateway, monkeypatch, caplog
):
    # A ValueError is no validation error: a bug building the answer must not be a 400.
    monkeypatch.setattr(completions, "_usage", functools.partial(raise_bug, exception=ValueError))
    response = httpx.post(
        gateway.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT
    )
    assert response.status_code == 500, response.text
    assert response.json()["error"]["type"] == "server_error"
    assert logged_with_traceback(caplog)


# (route, body, the module and its function that fail at the stream's end)
STREAMS = [
    (
        "/v1/completions",
        {
            "prompt": "Hi",
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        completions,
        "_usage",  # the usage chunk comes last
    ),
    (
        "/v1/responses",
        {"input": "Hi", "max_output_tokens": 2, "stream": True},
        translate,
        "response_usage",  # the usage comes with the last event
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "module", "name"), STREAMS, ids=["completions", "responses"]
)
def test_an_error_after_the_stream_started_is_logged(
    gateway, monkeypatch, caplog, route, body, module, name
):
    monkeypatch.setattr(module, name, raise_bug)
    with httpx.stream("POST", gateway.url + route, json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    error = events[-1].get("error", events[-1])  # the Responses API's error event is flat
    assert BUG in error["message"]
    assert logged_with_traceback(caplog)
