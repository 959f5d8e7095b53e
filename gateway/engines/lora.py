"""Which LoRA adapter the current request runs with: set once its "model" names an adapter
(Gateway.check_model), read where its engine request is written (gateway.engines.clients), as
gateway.limits.service_level does for service levels. A context variable, so each request's
task sees only its own; unset, the base model. Holds the name only: never asks the engine."""

from __future__ import annotations

from contextvars import ContextVar

_current: ContextVar[str | None] = ContextVar("folio_lora_name", default=None)


def set_lora(name: str | None) -> None:
    _current.set(name)


def current_lora() -> str | None:
    return _current.get()
