"""The errors a caller can act on, and ONE table of what each one is on every wire: its gRPC
status code, its HTTP status and its OpenAI error type and code.

Libraries (engine, tokenizer) and the gateway raise these exceptions; servers turn them into
status codes with status_code_for, clients turn codes back with error_for, and the gateway
answers HTTP with http_error_for. Torch-free and import-free of every Folio package but this
one: this module holds the mapping only, and must never decide whether a request is valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


class FolioError(Exception):
    """Base class of the errors a caller can act on. `param`, when known, names the request
    field at fault, as the caller spelled it (e.g. "response_format")."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidRequestError(FolioError, ValueError):
    """The request itself is wrong; its message names the offending parameter first."""


class InvalidParameter(InvalidRequestError):
    """A request field the gateway refuses; `param` names the field."""


class ModelNotFound(InvalidParameter):
    """The request names a model this server does not serve."""


class NotFound(InvalidParameter):
    """The request names an object (a file, a batch job) the caller has none of."""


class UnsupportedMediaType(InvalidParameter):
    """The body is not declared as JSON."""


class RequestTooLarge(InvalidParameter):
    """The body is over the gateway's size limit."""


class Unauthenticated(FolioError):
    """No valid API key came with the request."""


class QueueFullError(FolioError):
    """The bounded waiting queue is full; retry later. `retry_after`: whole seconds until the
    request would pass, when known."""

    def __init__(
        self, message: str = "", param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message, param)
        self.retry_after = retry_after


class DeadlineUnmeetable(QueueFullError):
    """The request's deadline cannot be met behind the requests queued ahead of it."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, retry_after=retry_after)


class RateLimitExceeded(QueueFullError):
    """The caller is over a rate limit. `retry_after`: whole seconds until the request would
    pass; None when waiting cannot make it pass."""

    def __init__(self, message: str, retry_after: int | None) -> None:
        super().__init__(message, retry_after=retry_after)


class UnavailableError(FolioError):
    """The service cannot take work now: warming up (loading the model) or draining."""


class InternalError(FolioError):
    """The service failed for a reason the caller cannot fix."""


class DeadlineExceededError(FolioError):
    """The request ran out of time (its gRPC deadline or the gateway's request timeout)."""


@dataclass(frozen=True)
class ErrorMapping:
    """What one kind of error is on each wire. `from_status`: the exception a client raises
    when a service answers `grpc_code` (one per code)."""

    error: type[BaseException]
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    openai_code: str | None = None
    from_status: bool = False


_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_REQUEST_ERROR = "invalid_request_error"

# Most specific first: the first row whose class the exception is an instance of wins.
ERROR_TABLE: tuple[ErrorMapping, ...] = (
    ErrorMapping(ModelNotFound, _INVALID, 404, _REQUEST_ERROR, "model_not_found"),
    ErrorMapping(
        NotFound, grpc.StatusCode.NOT_FOUND, 404, _REQUEST_ERROR, "not_found", from_status=True
    ),
    ErrorMapping(UnsupportedMediaType, _INVALID, 415, _REQUEST_ERROR),
    ErrorMapping(RequestTooLarge, _INVALID, 413, _REQUEST_ERROR, "request_too_large"),
    ErrorMapping(InvalidRequestError, _INVALID, 400, _REQUEST_ERROR, from_status=True),
    ErrorMapping(
        Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, 401, _REQUEST_ERROR, "invalid_api_key"
    ),
    ErrorMapping(
        RateLimitExceeded,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
    ),
    ErrorMapping(
        QueueFullError,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        429,
        "rate_limit_error",
        "queue_full",
        from_status=True,
    ),
    ErrorMapping(
        UnavailableError, grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", from_status=True
    ),
    # The gateway's request timeout, or a service's deadline: the caller gave up waiting.
    ErrorMapping(
        DeadlineExceededError,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        504,
        "timeout",
        "request_timeout",
        from_status=True,
    ),
)
# Anything else (InternalError included) is a bug or a failure the caller cannot fix: a plain
# ValueError too, since only an InvalidRequestError says the request is at fault.
UNEXPECTED = ErrorMapping(
    InternalError, grpc.StatusCode.INTERNAL, 500, "server_error", from_status=True
)


def _errors_from_status() -> dict[grpc.StatusCode, type[FolioError]]:
    errors: dict[grpc.StatusCode, type[FolioError]] = {}
    for row in (*ERROR_TABLE, UNEXPECTED):
        if row.from_status:
            assert issubclass(row.error, FolioError) and row.grpc_code not in errors
            errors[row.grpc_code] = row.error
    return errors


_FROM_STATUS = _errors_from_status()


def mapping_for(error: BaseException) -> ErrorMapping:
    """The table's row for this exception; UNEXPECTED for anything it does not list."""
    for row in ERROR_TABLE:
        if isinstance(error, row.error):
            return row
    return UNEXPECTED


def status_code_for(error: BaseException) -> grpc.StatusCode:
    """The status code a server answers for this exception; INTERNAL for anything unexpected."""
    return mapping_for(error).grpc_code


def status_code(number: int) -> grpc.StatusCode:
    """The status code a number on the wire stands for; UNKNOWN for one gRPC does not define."""
    return next((c for c in grpc.StatusCode if c.value[0] == number), grpc.StatusCode.UNKNOWN)


def error_for(
    code: grpc.StatusCode | int,
    message: str,
    param: str | None = None,
    retry_after: int | None = None,
) -> FolioError:
    """The exception a client raises for a status code (an enum or its number on the wire);
    InternalError for a code no row claims. `retry_after` (seconds) goes on a QueueFullError."""
    if isinstance(code, int):
        code = status_code(code)
    error = _FROM_STATUS.get(code, InternalError)(message, param)
    if isinstance(error, QueueFullError):
        error.retry_after = retry_after
    return error
