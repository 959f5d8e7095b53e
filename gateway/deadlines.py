"""Deadlines of gateway requests: the gateway's --request-timeout, or a gRPC caller's own
deadline when that is sooner.

Every request the gateway sends to the engine rides on one shared Generate stream
(gateway/clients.py), so a request's deadline cannot be a gRPC deadline there: `until_deadline`
ends the request's text stream when the deadline passes, which aborts its engine request the way
a client leaving does, and raises DeadlineExceededError. Unary calls to the tokenizer and the
engine made in a task that has a deadline (`set_deadline`) carry what is left of it as their gRPC
deadline, so it reaches those services too. Time only: this module never decides anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import TypeVar

from common.errors import DeadlineExceededError

T = TypeVar("T")

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


async def until_deadline(
    stream: AsyncIterator[T], deadline: float, message: str
) -> AsyncIterator[T]:
    """`stream` until `deadline` (time.monotonic seconds); then it is closed (aborting what it
    runs) and DeadlineExceededError(message) is raised. Closing this closes `stream`."""
    async with contextlib.aclosing(stream):
        while True:
            try:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise DeadlineExceededError(message) from None
            yield item


def _loop_time(deadline: float) -> float:
    # asyncio's clock is time.monotonic on every supported platform, but not by contract.
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
