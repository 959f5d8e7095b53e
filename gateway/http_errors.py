"""The HTTP answer to a failed request: the exception's status, the OpenAI error body and the
headers that go with it (WWW-Authenticate, Retry-After).

The mapping only, read from the contract's one error table (common/errors.py). It never decides
whether a request is valid.
"""

from __future__ import annotations

from common.errors import RateLimitExceeded, Unauthenticated, mapping_for
from gateway.protocol import ErrorInfo, ErrorResponse


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
    if isinstance(exc, RateLimitExceeded) and exc.retry_after is not None:
        return {"Retry-After": str(exc.retry_after)}
    return {}
