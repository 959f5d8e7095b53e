"""Per-caller rate limits of the gateway: requests per second and tokens per minute, each a token
bucket per caller (an API key's name from common.auth, or the client's address when the gateway
has no keys).

A request is charged one request on arrival and, once its prompt is tokenized, prompt plus
max_tokens tokens for each sequence it runs: the most it can use, so a burst cannot overrun the
limit. When a sequence finishes, the max_tokens it did not generate are given back, and a
request the engine refuses before producing anything (queue full) gets all back. A refusal
says how many whole seconds until the same request would pass (HTTP Retry-After); a request
larger than a whole minute's tokens can never pass and is told so. Buckets start full: a caller's
first minute may use the whole allowance at once. The buckets live in this process
(LocalBuckets), or, for a gateway of several worker processes, in a file they all share
(gateway/limits/shared_buckets.py): a limit is then the whole server's, not each worker's. This
module decides admission only: it never reads credentials or talks to a service.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from common.errors import RateLimitExceeded
from gateway.pipeline.text import TextDelta, TextRequest

# Buckets of callers that have been idle long enough to be full again carry no state: they are
# dropped once this many callers are tracked, so that many client addresses cannot grow memory.
MAX_TRACKED_CALLERS = 10_000


@dataclass
class TokenBucket:
    rate: float  # units added per second
    capacity: float
    level: float
    updated: float  # monotonic seconds of the last refill

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, amount: float, now: float) -> float:
        """Take `amount` and return 0.0, or take nothing and return the seconds until `amount`
        is there (infinity if it never fits)."""
        self.refill(now)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate

    def give_back(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


class Buckets(Protocol):
    """One limit's token buckets, by caller, all with the same rate and capacity; a caller's
    bucket starts full."""

    def take(self, caller: str, amount: float, now: float) -> float:
        """TokenBucket.take on the caller's bucket."""
        ...

    def give_back(self, caller: str, amount: float, now: float) -> None: ...


# Makes the buckets of one limit: (the limit's name, rate per second, capacity).
BucketsFactory = Callable[[str, float, float], Buckets]


class LocalBuckets:
    """Buckets in this process's memory."""

    def __init__(self, name: str, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self._buckets: dict[str, TokenBucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, caller: str, amount: float, now: float) -> float:
        bucket = self._buckets.get(caller)
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_CALLERS:
                self._forget_full(now)
            bucket = self._buckets[caller] = TokenBucket(
                self.rate, self.capacity, self.capacity, now
            )
        return bucket.take(amount, now)

    def give_back(self, caller: str, amount: float, now: float) -> None:
        bucket = self._buckets.get(caller)
        if bucket is not None:  # else forgotten when full: it starts full again anyway
            bucket.give_back(amount, now)

    def _forget_full(self, now: float) -> None:
        for caller, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.level >= bucket.capacity:
                del self._buckets[caller]


class TokenReservation:
    """`amount` tokens taken for one request; what its sequences did not use goes back."""

    def __init__(
        self, limiter: RateLimiter, buckets: Buckets | None, caller: str, amount: int
    ) -> None:
        self._limiter = limiter
        self._buckets = buckets
        self._caller = caller
        self.amount = amount

    def give_back(self, amount: int) -> None:
        if self._buckets is not None and amount > 0:
            self._buckets.give_back(self._caller, amount, self._limiter.clock())


class RateLimiter:
    """Token buckets per caller for requests per second and tokens per minute (None: no limit)."""

    def __init__(
        self,
        requests_per_second: float | None,
        tokens_per_minute: int | None,
        clock: Callable[[], float] = time.monotonic,
        buckets: BucketsFactory = LocalBuckets,
    ) -> None:
        """`clock`: monotonic seconds, the same for every process sharing `buckets`."""
        self.requests_per_second = requests_per_second
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        # A second's worth of burst, and at least one request (a rate below 1/s still admits).
        self._requests = (
            None
            if requests_per_second is None
            else buckets("requests", requests_per_second, max(requests_per_second, 1.0))
        )
        self._tokens = (
            None
            if tokens_per_minute is None
            else buckets("tokens", tokens_per_minute / 60, tokens_per_minute)
        )

    def admit_request(self, caller: str) -> None:
        """Charge one request to `caller`; RateLimitExceeded if over requests per second."""
        if self._requests is None:
            return
        wait = self._requests.take(caller, 1, self.clock())
        if wait:
            raise RateLimitExceeded(
                f"rate limit reached: {self.requests_per_second:g} requests per second for "
                f"{_who(caller)}; retry in {math.ceil(wait)} s",
                math.ceil(wait),
            )

    def reserve_tokens(self, caller: str, requests: Sequence[TextRequest]) -> TokenReservation:
        """Charge prompt + max_tokens of every sequence (each of a request's n choices) to
        `caller`; RateLimitExceeded if over tokens per minute."""
        if self._tokens is None or self.tokens_per_minute is None:
            return TokenReservation(self, None, caller, 0)
        amount = sum(r.params.n * (len(r.prompt_ids) + r.max_tokens) for r in requests)
        limit = self.tokens_per_minute
        wait = self._tokens.take(caller, amount, self.clock())
        if wait == math.inf:
            raise RateLimitExceeded(
                f"request too large: it may use {amount} tokens (prompt plus max_tokens for each "
                f"sequence), over the limit of {limit} tokens per minute for {_who(caller)}; "
                f"lower max_tokens or shorten the prompt",
                None,
            )
        if wait:
            raise RateLimitExceeded(
                f"rate limit reached: {limit} tokens per minute for {_who(caller)}, and this "
                f"request may use {amount}; retry in {math.ceil(wait)} s",
                math.ceil(wait),
            )
        return TokenReservation(self, self._tokens, caller, amount)


def _who(caller: str) -> str:
    return "this API key" if caller.startswith("key-") else "this client"


async def giving_back_unused(
    stream: AsyncGenerator[tuple[int, TextDelta], None],
    requests: Sequence[TextRequest],
    reservation: TokenReservation,
) -> AsyncGenerator[tuple[int, TextDelta], None]:
    """`stream` (Gateway.generate_many's), giving back each finished sequence's unused
    max_tokens, or everything if it fails before its first delta; closing it closes `stream`."""
    max_tokens = [r.max_tokens for r in requests for _ in range(r.params.n)]  # by choice
    started = False
    try:
        async for index, delta in stream:
            started = True
            if delta.usage is not None:
                reservation.give_back(max_tokens[index] - delta.usage.completion_tokens)
            yield index, delta
    except Exception:
        if not started:  # refused (queue full, unavailable): it cost the engine nothing
            reservation.give_back(reservation.amount)
        raise
    finally:
        await stream.aclose()
