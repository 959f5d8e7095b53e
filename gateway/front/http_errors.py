"""The HTTP answer to a failed request: the exception's status, the OpenAI error body and the
headers that go with it (WWW-Authenticate, Retry-After).

The mapping only, read from the contract's one error table (common/errors.py), and the server's
log of what failed. It never decides whether a request is valid.
"""

from __future__ import annotations

import logging

from common.errors import QueueFullError, Unauthenticated, UnavailableError, mapping_for
from gateway.openai.protocol import ErrorInfo, ErrorResponse
from gateway.pipeline.output_processor import OutputProcessingError

logger = logging.getLogger(__name__)

# Seconds a 503 asks the client to wait: enough not to hammer a service that is starting
# again, little enough not to delay a client once it is back.
UNAVAILABLE_RETRY_AFTER_SECONDS = 1


def error_body(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The HTTP status and OpenAI error body for an exception (anything unknown is a 500)."""
    row = mapping_for(exc)
    message = str(exc) if row.http_status != 500 else f"internal error: {exc}"
    return row.http_status, ErrorResponse(
        error=ErrorInfo(
            message=message,
            type=row.openai_type,
            param=getattr(exc, "param", None),
            code=row.openai_code,
        )
    )


def error_headers(exc: BaseException) -> dict[str, str]:
    """The HTTP headers an error answer carries besides its body."""
    if isinstance(exc, Unauthenticated):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, QueueFullError) and exc.retry_after is not None:
        # Over a rate limit, or a deadline the engine's queue cannot meet for now.
        return {"Retry-After": str(exc.retry_after)}
    if isinstance(exc, UnavailableError):
        return {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)}
    return {}


def log_failure(exc: BaseException, started: bool = False) -> None:
    """Log a failed request (either API): a 500, a bug or a failure the caller cannot fix, with
    its traceback; with `started` (the answer had begun: no status code records the failure)
    any other error too, as a warning."""
    status = mapping_for(exc).http_status
    when = " after its answer started" if started else ""
    if isinstance(exc, OutputProcessingError):  # one bug, many requests: one traceback
        logger.error("request failed%s: %s (traceback logged above)", when, exc)
    elif status == 500:
        logger.error("request failed%s", when, exc_info=exc)
    elif started:
        logger.warning("request failed%s: %d %s", when, status, exc)
