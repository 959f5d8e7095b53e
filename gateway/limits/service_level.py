"""A request's service level at the gateway: the tenant whose fair share serves it, that
tenant's weight, and its deadlines, from its headers over its API key's settings (the key file,
common/auth.py), for the engine to schedule by (common/service_level.py).

Headers: `x-slo-ttft-ms` (first token) and `x-slo-total-ms` (end), in milliseconds from the
request's arrival at the gateway; `x-tenant` only when the gateway is told to trust it
(--trust-tenant-header: a proxy in front names the tenant). The gRPC text API's calls ask the
same in their ServiceLevel field (gateway.messages.AskedLevel). Otherwise the tenant is the key's
`tenant=` setting, else the caller (the key's name, or the client address without keys).

The front end sets the level for the request's task once the key is checked
(`set_service_level`); the engine request built in that task carries what is left of the
deadlines then (`current_service_level`), as limits/deadlines.py does for gRPC deadlines. It
reads headers and settings only: it never schedules and never waits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from common.auth import KeySettings, key_of, key_settings
from common.config import GatewayConfig
from common.errors import InvalidParameter
from common.service_level import NO_SERVICE_LEVEL, ServiceLevel
from gateway.messages import AskedLevel

SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TOTAL_HEADER = "x-slo-total-ms"
TENANT_HEADER = "x-tenant"
NO_SETTINGS = KeySettings()


@dataclass(frozen=True)
class _Started:
    level: ServiceLevel
    since: float  # time.monotonic() when its deadlines began to count


_current: ContextVar[_Started | None] = ContextVar("folio_service_level", default=None)


def set_service_level(level: ServiceLevel, since: float | None = None) -> None:
    """The current task's requests are served at `level`, its deadlines counted from `since`
    (time.monotonic seconds; now by default)."""
    _current.set(_Started(level, time.monotonic() if since is None else since))


def current_service_level() -> ServiceLevel:
    """The current task's level with what is left of its deadlines (NO_SERVICE_LEVEL when none
    was set); a deadline already spent leaves a sliver, which the engine refuses as below one
    of its steps."""
    started = _current.get()
    if started is None:
        return NO_SERVICE_LEVEL
    return started.level.after(time.monotonic() - started.since)


class ServiceLevels:
    """Each caller's service level: its API key's settings, what its headers ask."""

    def __init__(self, config: GatewayConfig) -> None:
        self.trust_tenant_header = config.trust_tenant_header
        # By key name ("key-<i>", as common.auth.KeySet names them: first entry of each key).
        entries: dict[str, str] = {}
        for entry in config.api_keys:
            entries.setdefault(key_of(entry), entry)
        self._settings = {
            f"key-{i}": key_settings(entry) for i, entry in enumerate(entries.values())
        }
        # A tenant named by a key's tenant= setting has that key's weight (the first such key).
        self._tenant_weights: dict[str, float] = {}
        for settings in self._settings.values():
            if settings.tenant is not None:
                self._tenant_weights.setdefault(settings.tenant, settings.weight)

    def of(self, caller: str | None, headers: Mapping[str, str]) -> ServiceLevel:
        """The level of an HTTP request from `caller` (Access's name for it; None on an open
        path) with `headers`; InvalidParameter naming a header that does not parse."""
        return self.of_call(
            caller,
            AskedLevel(
                _milliseconds(headers.get(SLO_TTFT_HEADER), SLO_TTFT_HEADER),
                _milliseconds(headers.get(SLO_TOTAL_HEADER), SLO_TOTAL_HEADER),
                headers.get(TENANT_HEADER) or None,
            ),
        )

    def of_call(self, caller: str | None, asked: AskedLevel) -> ServiceLevel:
        """The level of a call from `caller` that asks `asked` (the gRPC API's ServiceLevel,
        or the HTTP headers'); InvalidParameter naming a deadline out of range. The tenant it
        names counts only when the gateway trusts it."""
        settings = self._settings.get(caller or "", NO_SETTINGS)
        tenant = settings.tenant or caller or ""
        weight = settings.weight
        if asked.tenant and self.trust_tenant_header:
            tenant, weight = asked.tenant, self._tenant_weights.get(asked.tenant, 1.0)
        return ServiceLevel(
            tenant,
            weight,
            _checked(asked.ttft_ms, "slo_ttft_ms", settings.slo_ttft_ms),
            _checked(asked.total_ms, "slo_total_ms", settings.slo_total_ms),
        )


def _milliseconds(value: str | None, header: str) -> float | None:
    """A deadline header's milliseconds (None when absent)."""
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        raise InvalidParameter(
            f"{header} must be a positive number of milliseconds, got {value!r}", header
        ) from None
    return _checked(ms, header, None)


def _checked(ms: float | None, name: str, default: float | None) -> float | None:
    """`ms` (`default` when None), InvalidParameter naming `name` unless a positive number."""
    if ms is None:
        return default
    if not (ms > 0 and math.isfinite(ms)):
        raise InvalidParameter(f"{name} must be a positive number of milliseconds, got {ms}", name)
    return ms
