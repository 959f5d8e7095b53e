"""The one error table: each error a caller can act on has one gRPC code, one HTTP status and
one OpenAI error type, and comes back from its code as the same kind of error with its message
and the field it names; FinishReason crosses the wire and back unchanged."""

from __future__ import annotations

import grpc
import pytest
from common.grpc_stubs.folio.v1 import common_pb2

from common.errors import (
    ERROR_TABLE,
    DeadlineExceededError,
    InternalError,
    InvalidParameter,
    InvalidRequestError,
    ModelNotFound,
    QueueFullError,
    RateLimitExceeded,
    RequestTooLarge,
    Unauthenticated,
    UnavailableError,
    UnsupportedMediaType,
    error_for,
    mapping_for,
    status_code_for,
)
from common.finish_reason import FinishReason, finish_reason_from_proto, finish_reason_to_proto

INVALID = grpc.StatusCode.INVALID_ARGUMENT
REQUEST, RATE = "invalid_request_error", "rate_limit_error"


@pytest.mark.parametrize(
    "error, code, http_status, openai_type, openai_code",
    [
        (InvalidParameter("bad top_p", "top_p"), "INVALID_ARGUMENT", 400, REQUEST, None),
        (InvalidRequestError("n is 65"), "INVALID_ARGUMENT", 400, REQUEST, None),
        (ModelNotFound("no model", "model"), "INVALID_ARGUMENT", 404, REQUEST, "model_not_found"),
        (UnsupportedMediaType("send JSON"), "INVALID_ARGUMENT", 415, REQUEST, None),
        (RequestTooLarge("too big"), "INVALID_ARGUMENT", 413, REQUEST, "request_too_large"),
        (Unauthenticated("no key"), "UNAUTHENTICATED", 401, REQUEST, "invalid_api_key"),
        (RateLimitExceeded("slow down", 2), "RESOURCE_EXHAUSTED", 429, RATE, "rate_limit_exceeded"),
        (QueueFullError("queue full"), "RESOURCE_EXHAUSTED", 429, RATE, "queue_full"),
        (UnavailableError("draining"), "UNAVAILABLE", 503, "service_unavailable", None),
        (DeadlineExceededError("late"), "DEADLINE_EXCEEDED", 504, "timeout", "request_timeout"),
        (InternalError("boom"), "INTERNAL", 500, "server_error", None),
        (RuntimeError("a bug"), "INTERNAL", 500, "server_error", None),
        # Only an InvalidRequestError says the request is at fault: a bare ValueError is a bug.
        (ValueError("a bug"), "INTERNAL", 500, "server_error", None),
    ],
)  # fmt: skip
def test_each_error_has_one_row(error, code, http_status, openai_type, openai_code):
    row = mapping_for(error)
    assert (row.grpc_code.name, row.http_status, row.openai_type, row.openai_code) == (
        code,
        http_status,
        openai_type,
        openai_code,
    )
    assert status_code_for(error) == grpc.StatusCode[code]


def test_every_code_a_service_answers_comes_back_as_its_error_with_the_field_it_names():
    for row in ERROR_TABLE:
        if row.from_status:
            back = error_for(row.grpc_code.value[0], "msg", "guided_json")
            assert type(back) is row.error and str(back) == "msg"
            assert back.param == "guided_json"
    # A client's own errors (a bad API key, the gateway's media type) never come back from a
    # service's code: UNAUTHENTICATED from a service is a misconfiguration, not the caller's.
    assert type(error_for(grpc.StatusCode.UNAUTHENTICATED, "internal token")) is InternalError
    assert type(error_for(INVALID, "bad")) is InvalidRequestError


def test_finish_reasons_cross_the_wire_and_back():
    for reason in FinishReason:
        assert finish_reason_from_proto(finish_reason_to_proto(reason)) is reason
        assert finish_reason_to_proto(reason.value) == finish_reason_to_proto(reason)
    assert finish_reason_to_proto("length") == common_pb2.FINISH_REASON_LENGTH
    with pytest.raises(ValueError, match="finish_reason 0"):
        finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED)
