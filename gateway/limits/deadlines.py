"""Deadlines of gateway requests: the gateway's --request-timeout, or a gRPC caller's own
deadline when that is sooner.

Every request the gateway sends to the engine rides on one shared Generate stream
(gateway/engines/clients.py), so a request's deadline cannot be a gRPC deadline there: a timer
(`at_deadline`) ends the request's text stream with DeadlineExceededError when the deadline
passes, which aborts its engine request the way a client leaving does. Unary calls to the
tokenizer and the engine made in a task that has a deadline (`set_deadline`) carry what is left
of it as their gRPC deadline, so it reaches those services too. Time only: this module never
decides anything else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextvars import ContextVar

from common.errors import DeadlineExceededError

# A monotonic time; set per task (a request's handler), so requests never see each other's.
_deadline: ContextVar[float | None] = ContextVar("folio_request_deadline", default=None)


def set_deadline(deadline: float) -> None:
    """The current task's requests must end by `deadline` (time.monotonic seconds)."""
    _deadline.set(deadline)


def call_timeout(limit: float) -> float:
    """The timeout of one unary call: `limit`, or what is left of the task's deadline if less.
    DeadlineExceededError when nothing is left."""
    deadline = _deadline.get()
    if deadline is None:
        return limit
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError("the request's deadline passed")
    return min(limit, left)


def timeout_message(seconds: float) -> str:
    return f"the request did not finish within {seconds:g} s and was aborted"


def at_deadline(deadline: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
    """Call `callback` on the running loop when `deadline` (time.monotonic seconds) passes; at
    once if it has. One timer for a whole request: cancel the handle when it ends."""
    return asyncio.get_running_loop().call_at(_loop_time(deadline), callback)


def _loop_time(deadline: float) -> float:
    # asyncio's clock is time.monotonic on every supported platform, but not by contract.
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
