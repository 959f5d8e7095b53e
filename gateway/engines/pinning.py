"""How long the current request asks the engine to pin its prompt's KV blocks: set once its
body is read (a chat request's `cache` extension, an Anthropic `cache_control`), read where its
engine request is written (gateway.engines.clients), as gateway.engines.lora does for adapters.
A context variable, so each request's task sees only its own; unset, no pin. Holds the TTL
only: it never checks a bound (the engine clips pins to its share of the pool)."""

from __future__ import annotations

from contextvars import ContextVar

_current: ContextVar[float] = ContextVar("folio_pin_ttl_seconds", default=0.0)


def set_pin(ttl_seconds: float) -> None:
    _current.set(ttl_seconds)


def current_pin() -> float:
    return _current.get()
