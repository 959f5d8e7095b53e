"""Failures that are the gateway's own (a bug in it, injected here into the real gateway), not
the client's and not an engine's: the client gets a 500, the server log gets the traceback."""

from __future__ import annotations

import functools
import logging
import traceback

import httpx
import pytest

from gateway import completions
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
