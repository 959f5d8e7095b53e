"""The one serving function both front ends call (the HTTP routes and the gRPC API): planned
TextRequests in, (choice index, TextDelta) out, charged to the caller's token budget and bounded
by the request's deadline.

It orders what every generation goes through: the token reservation (RateLimitExceeded before
anything runs), the generation pipeline, giving back what a finished sequence did not use, and
the deadlines (DeadlineExceededError: the gateway's request timeout, or the request's own total
deadline, x-slo-total-ms, at which the engine ended it with finish_reason "deadline"). It never
parses a wire format and never decides what a request means.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence

from common.errors import DeadlineExceededError
from common.finish_reason import FinishReason
from gateway.limits.deadlines import timeout_message
from gateway.limits.rate_limit import RateLimiter, giving_back_unused
from gateway.pipeline.generation import Gateway
from gateway.pipeline.text import TextDelta, TextRequest


def serve(
    gateway: Gateway,
    limiter: RateLimiter,
    caller: str,
    requests: Sequence[TextRequest],
    request_id: str,
    arrival: float,
    deadline: float,
    timeout: float,
) -> AsyncGenerator[tuple[int, TextDelta], None]:
    """The deltas of `requests`; closing the iterator early aborts what still runs. `timeout`
    is what the deadline was set from, for the message when it passes."""
    reservation = limiter.reserve_tokens(caller, requests)
    return _deadline_as_error(
        giving_back_unused(
            gateway.generate_many(
                requests, request_id, arrival, deadline, timeout_message(timeout)
            ),
            requests,
            reservation,
        )
    )


async def _deadline_as_error(
    stream: AsyncGenerator[tuple[int, TextDelta], None],
) -> AsyncGenerator[tuple[int, TextDelta], None]:
    """`stream`, failing with DeadlineExceededError where the engine ended a sequence at the
    request's total deadline (what ran by then is no answer the caller asked for)."""
    async with contextlib.aclosing(stream):
        async for index, delta in stream:
            if delta.finish_reason == FinishReason.DEADLINE:
                raise DeadlineExceededError(
                    "the request did not end within its total deadline (x-slo-total-ms, or its "
                    f"API key's slo_total_ms): the engine ended it after "
                    f"{delta.usage.completion_tokens if delta.usage else 0} tokens"
                )
            yield index, delta
