"""Who may call the gateway, and how often: the API key check and the per-caller request rate
of its HTTP routes and of its gRPC API (where common.auth.KeyInterceptor refuses calls without a
key before they reach the servicer).

With API keys configured, every HTTP route but the probe paths (/health, /metrics,
/dashboard/feed and what SMG polls: /server_info, /model_info, /v1/loads; those too with
--protect-health-metrics) needs `Authorization: Bearer <key>` (or `x-api-key: <key>`, as
Anthropic's clients send it); a caller is then its key's name ("key-0"), else its client
address. The web pages and their files are open: they hold no
data, and the API calls they make carry the key. A browser's EventSource cannot send headers, so
the dashboard's feed also takes the key as the `api_key` query parameter or the
`folio_api_key` cookie. A key is never logged, echoed or kept in plain text here.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import grpc
from starlette.requests import Request

from common.auth import KeySet, bearer_token, grpc_presented_key
from common.config import GatewayConfig
from common.errors import Unauthenticated
from gateway.front.pages import PAGES, STATIC_PREFIX
from gateway.limits.rate_limit import LocalBuckets, RateLimiter
from gateway.limits.service_level import ServiceLevels
from gateway.limits.shared_buckets import SharedBuckets

# Routes that probes, scrapers, dashboards and routers in front (SMG) reach without a key unless
# --protect-health-metrics. They show what /metrics shows.
PROBE_PATHS = frozenset(
    {"/health", "/metrics", "/dashboard/feed", "/server_info", "/model_info", "/v1/loads"}
)
# Where a key may also come as a query parameter or a cookie (read by EventSource).
BROWSER_KEY_PATHS = frozenset({"/dashboard/feed"})
KEY_QUERY_PARAMETER = "api_key"
KEY_COOKIE = "folio_api_key"
# Who owns what is stored when the gateway has no API keys: every caller, as one.
ANONYMOUS_OWNER = "anonymous"
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send it as Authorization: Bearer <key>"


class Access:
    """The gateway's keys and rate limits, shared by its HTTP and gRPC APIs."""

    def __init__(self, config: GatewayConfig, shared_state: Path | None = None) -> None:
        """`shared_state`: the directory where the workers of one gateway keep the rate-limit
        buckets they share; None: a gateway of one process keeps them in memory."""
        self.keys = KeySet(config.api_keys)
        buckets = (
            LocalBuckets
            if shared_state is None
            else functools.partial(SharedBuckets.in_directory, shared_state)
        )
        self.limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_tpm, buckets=buckets)
        self.protect_health_metrics = config.protect_health_metrics
        self.service_levels = ServiceLevels(config)

    def caller(self, presented_key: str | None, address: str | None) -> str:
        """The caller's name for rate limits; Unauthenticated without a valid key when keys
        are configured."""
        if not self.keys:
            return f"client-{address or 'unknown'}"
        name = self.keys.identify(presented_key)
        if name is None:
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        return name

    def admit_http(self, request: Request) -> str | None:
        """Check the key and charge one request; the caller, or None for an open path (a web
        page or file, or a probe path without --protect-health-metrics).
        Raises Unauthenticated or RateLimitExceeded. Probes are never rate limited: a busy
        key must not make its server look unhealthy."""
        path = request.url.path
        if is_web_file(path):
            return None
        probe = path in PROBE_PATHS
        if probe and not self.protect_health_metrics:
            return None
        caller = self.caller(
            _presented_key(request), request.client.host if request.client else None
        )
        if not probe:
            self.limiter.admit_request(caller)
        return caller

    def owner(self, request: Request) -> str:
        """Who owns what a caller stores (batch files and jobs; pinned prefixes, named by the
        digest's first characters), for a request admit_http let in: its API key as a SHA-256
        digest (a key keeps what it owns when the key list changes order), or ANONYMOUS_OWNER
        when no keys are configured."""
        key = _presented_key(request)
        if not self.keys or key is None:
            return ANONYMOUS_OWNER
        return "key-sha256:" + hashlib.sha256(key.encode()).hexdigest()

    def admit_grpc(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """Charge one request to a gRPC call's caller (the interceptor checked its key)."""
        caller = self.caller(
            grpc_presented_key(context.invocation_metadata()), _peer_host(context.peer())
        )
        self.limiter.admit_request(caller)
        return caller


def is_web_file(path: str) -> bool:
    """A web page or one of its scripts and styles (gateway/front/pages.py)."""
    return path in PAGES or path.startswith(STATIC_PREFIX)


def _presented_key(request: Request) -> str | None:
    # Anthropic's clients send the key as x-api-key.
    key = bearer_token(request.headers.get("authorization")) or request.headers.get("x-api-key")
    if key is None and request.url.path in BROWSER_KEY_PATHS:
        key = request.query_params.get(KEY_QUERY_PARAMETER) or request.cookies.get(KEY_COOKIE)
    return key


def _peer_host(peer: str) -> str:
    """The address part of a gRPC peer ("ipv4:127.0.0.1:5000" -> "127.0.0.1")."""
    address = peer.split(":", 1)[-1]
    return address.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else address
