"""Library exceptions <-> gRPC status codes, in one place for every service and client.

The engine and tokenizer libraries raise plain exceptions that name the offending parameter;
servers turn them into status codes here, and clients (the gateway) turn codes back. This
module holds the mapping only: it must never decide whether a request is valid.
"""

from __future__ import annotations

import grpc

from engine.errors import EngineError, EngineGroupError, InvalidRequestError, QueueFullError


class UnavailableError(EngineError):
    """The service cannot take work now: warming up (loading the model) or draining."""


class InternalError(EngineError):
    """The service failed for a reason the caller cannot fix."""


class DeadlineExceededError(EngineError):
    """The request ran out of time (its gRPC deadline or the gateway's request timeout)."""


# Most specific first: InvalidRequestError is also a ValueError.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    # A tensor-parallel rank died: this engine is going down, to be restarted; retry later.
    (EngineGroupError, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    # ValueError: the tokenizer's way of saying the input is wrong (e.g. a bad conversation).
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)
_ERRORS: dict[grpc.StatusCode, type[EngineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QueueFullError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def status_code_for(error: BaseException) -> grpc.StatusCode:
    """The status code a server answers for this exception; INTERNAL for anything unexpected."""
    for error_type, code in _CODES:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode | int, message: str) -> EngineError:
    """The exception a client raises for a status code (an enum or its number on the wire)."""
    if isinstance(code, int):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return _ERRORS.get(code, InternalError)(message)
