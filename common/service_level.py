"""A request's service level: whose share of the engine serves it (its tenant, and that tenant's
weight under the fair scheduling policy) and its deadlines, in milliseconds from its arrival:
for its first token and for its end. Plain data, part of the contract every service shares: the
gateway fills it from headers and API-key defaults, the engine schedules by it. It never decides
anything itself, beyond checking its own ranges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import InvalidRequestError


@dataclass(frozen=True)
class ServiceLevel:
    """`tenant` ("" when the gateway names none) with its `weight` (> 0); `ttft_ms` and
    `total_ms`: deadlines of the first token and of the end, None for none."""

    tenant: str = ""
    weight: float = 1.0
    ttft_ms: float | None = None
    total_ms: float | None = None

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
