"""The one serving function both front ends call (the HTTP routes and the gRPC API): planned
TextRequests in, (choice index, TextDelta) out, charged to the caller's token budget and bounded
by the request's deadline.

It orders what every generation goes through: the token reservation (RateLimitExceeded before
anything runs), the generation pipeline, giving back what a finished sequence did not use, and
the deadline (DeadlineExceededError). It never parses a wire format and never decides what a
request means.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

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
    return giving_back_unused(
        gateway.generate_many(requests, request_id, arrival, deadline, timeout_message(timeout)),
        requests,
        reservation,
    )
