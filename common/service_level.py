"""A request's service level: whose share of the engine serves it (its tenant, and that tenant's
weight under the fair scheduling policy) and its deadlines, in milliseconds from its arrival:
for its first token and for its end. Plain data, part of the contract every service shares: the
gateway fills it from headers and API-key defaults, the engine schedules by it. It never decides
anything itself, beyond checking its own ranges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from common.errors import InvalidRequestError

# What a deadline spent on the way leaves of it (milliseconds).
SPENT_MS = 0.001


@dataclass(frozen=True)
class ServiceLevel:
    """`tenant` ("" when the gateway names none) with its `weight` (> 0); `ttft_ms` and
    `total_ms`: deadlines of the first token and of the end, None for none."""

    tenant: str = ""
    weight: float = 1.0
    ttft_ms: float | None = None
    total_ms: float | None = None

    def after(self, seconds: float) -> ServiceLevel:
        """The same level `seconds` later: what is left of its deadlines (a spent one leaves a
        sliver, SPENT_MS, which an engine refuses as below one of its steps)."""
        if seconds <= 0 or (self.ttft_ms is None and self.total_ms is None):
            return self
        spent_ms = seconds * 1000

        def left(ms: float | None) -> float | None:
            return None if ms is None else max(ms - spent_ms, SPENT_MS)

        return replace(self, ttft_ms=left(self.ttft_ms), total_ms=left(self.total_ms))

    def check(self) -> None:
        """InvalidRequestError naming the field unless each is in range."""
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise InvalidRequestError(
                f"tenant_weight must be a positive number, got {self.weight}", "tenant_weight"
            )
        for name in ("ttft_ms", "total_ms"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise InvalidRequestError(
                    f"slo_{name} must be a positive number of milliseconds, got {value}",
                    f"slo_{name}",
                )


NO_SERVICE_LEVEL = ServiceLevel()
