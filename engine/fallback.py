"""What an optional speed-up says when it fails: Folio's C++ kernels and compiled decode steps
are speed-ups, and a failure to build or compile them (no compiler, a compiler error, an
inductor error) must never take the engine down. Their callers fall back to the plain path and
log one warning through `warn_fallback`, naming the cause in one line; the whole error (a
compiler's output runs to hundreds of lines) goes to the debug log. This module never decides
whether to fall back: the callers do.
"""

from __future__ import annotations

import logging

REASON_LIMIT = 300


def failure_reason(error: BaseException) -> str:
    """The error in one line: its type and the first line of its message that reports an
    error (a compiler's "error:" line rather than the command that ran it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = next((line for line in lines if "error:" in line.lower()), None)
    first = f"{type(error).__name__}: {telling or (lines[0] if lines else 'no message')}"
    return first if len(first) <= REASON_LIMIT else first[: REASON_LIMIT - 3] + "..."


def warn_fallback(
    logger: logging.Logger,
    speedup: str,
    fallback: str,
    cause: BaseException | str,
) -> None:
    """One warning: `speedup` unavailable, why (an error, or a reason found before trying),
    and what runs instead."""
    if isinstance(cause, str):
        logger.warning("%s unavailable (%s); %s", speedup, cause, fallback)
        return
    logger.warning("%s unavailable (%s); %s", speedup, failure_reason(cause), fallback)
    logger.debug("%s failed", speedup, exc_info=cause)
