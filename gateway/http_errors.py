"""The HTTP answer to a failed request: the exception's status, the OpenAI error body and the
headers that go with it (WWW-Authenticate, Retry-After).

The mapping only: the gateway's own refusals by their type, everything else by the gRPC status
code common.errors gives it. It never decides whether a request is valid.
"""

from __future__ import annotations

import grpc

from common.errors import status_code_for
from gateway.protocol import (
    ErrorInfo,
    ErrorResponse,
    ModelNotFound,
    RateLimitExceeded,
    RequestTooLarge,
    Unauthenticated,
    UnsupportedMediaType,
)


def error_body(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The HTTP status and OpenAI error body for an exception (anything unknown is a 500)."""
    if isinstance(exc, ModelNotFound):
        status, kind, code = 404, "invalid_request_error", "model_not_found"
    elif isinstance(exc, UnsupportedMediaType):
        status, kind, code = 415, "invalid_request_error", None
    elif isinstance(exc, RequestTooLarge):
        status, kind, code = 413, "invalid_request_error", "request_too_large"
    elif isinstance(exc, Unauthenticated):
        status, kind, code = 401, "invalid_request_error", "invalid_api_key"
    elif isinstance(exc, RateLimitExceeded):
        status, kind, code = 429, "rate_limit_error", "rate_limit_exceeded"
    else:
        status, kind, code = _HTTP_ERRORS.get(status_code_for(exc), _HTTP_ERRORS[None])
    message = str(exc) if status != 500 else f"internal error: {exc}"
    return status, ErrorResponse(
        error=ErrorInfo(message=message, type=kind, param=getattr(exc, "param", None), code=code)
    )


def error_headers(exc: BaseException) -> dict[str, str]:
    """The HTTP headers an error answer carries besides its body."""
    if isinstance(exc, Unauthenticated):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, RateLimitExceeded) and exc.retry_after is not None:
        return {"Retry-After": str(exc.retry_after)}
    return {}


# gRPC status (common.errors) -> HTTP status, OpenAI error type, code.
_HTTP_ERRORS: dict[grpc.StatusCode | None, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", None),
    # The gateway's request timeout, or a service's deadline: the gateway gave up waiting.
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "request_timeout"),
    None: (500, "server_error", None),
}
