"""What the current request asks the engine to pin of its prompt's KV blocks: the TTL, set once
its body is read (a chat request's `cache` extension, an Anthropic `cache_control`), and whose
pins they are with that owner's bound, set once its API key is checked; read where its engine
request is written (gateway.engines.clients), as gateway.engines.lora does for adapters.
Context variables, so each request's task sees only its own; unset, no pin. The owner is a
digest's first characters, never the key (it travels to the engine and into its logs); the
engine enforces both bounds: this module never counts pins.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

GIB = 1024**3
# How much of an owner ("key-sha256:<hex digest>" or "anonymous", gateway.limits.auth) names its
# pins: the prefix and 12 hex digits, enough to tell a gateway's keys apart, too little to stand
# for the key anywhere else.
OWNER_CHARS = len("key-sha256:") + 12


@dataclass(frozen=True)
class Pin:
    """The pin an engine request asks for: ttl_seconds 0 for none; `owner` and the bytes of KV
    that owner may pin at once (None: no bound but the engine's)."""

    ttl_seconds: float = 0.0
    owner: str = ""
    owner_max_bytes: int | None = None


NO_PIN = Pin()

_ttl: ContextVar[float] = ContextVar("folio_pin_ttl_seconds", default=0.0)
_owner: ContextVar[tuple[str, int | None]] = ContextVar("folio_pin_owner", default=("", None))


def set_pin(ttl_seconds: float) -> None:
    _ttl.set(ttl_seconds)


def set_pin_owner(owner: str, max_gib: float | None) -> None:
    """`owner`: who owns what the caller stores (gateway.limits.auth.Access.owner); max_gib:
    the gateway's --max-pinned-gib-per-key."""
    _owner.set((owner[:OWNER_CHARS], None if max_gib is None else int(max_gib * GIB)))


def current_pin() -> Pin:
    owner, max_bytes = _owner.get()
    return Pin(_ttl.get(), owner, max_bytes)
