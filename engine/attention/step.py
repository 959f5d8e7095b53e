"""The step being run, as the model's layers see it: which backend and which metadata their
attention uses, set once per forward instead of passed through every layer.

Attention is also one opaque op here (torch.ops.folio.attention), so that torch.compile traces
the layers around it and leaves the attention itself, which plans each step from host-side
lengths, to the backend (engine.compiled_decode). The layers call `attention` whatever runs
them; eagerly it goes straight to the backend. This module never computes attention itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata


@dataclass
class Step:
    backend: AttentionBackend
    meta: AttentionMetadata


# Per thread: an engine runs its steps in one thread, and two engines in one process (tests,
# several LLM objects) each in their own.
_current = threading.local()


@contextmanager
def running_step(backend: AttentionBackend, meta: AttentionMetadata) -> Iterator[None]:
    """The layers' attention reads this step's metadata while the block runs."""
    backend.prepare(meta)
    _current.step = Step(backend, meta)
    try:
        yield
    finally:
        _current.step = None


def _current_step() -> Step:
    step = getattr(_current, "step", None)
    if step is None:
        raise RuntimeError("attention was called outside a model forward (no running step)")
    return step


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """The running step's attention for one layer (AttentionBackend.forward's contract)."""
    if torch.compiler.is_compiling():
        return torch.ops.folio.attention(q, k, v, kv_cache, scale)
    step = _current_step()
    return step.backend.forward(q, k, v, kv_cache, step.meta, scale)


@torch.library.custom_op("folio::attention", mutates_args=("kv_cache",))
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    step = _current_step()
    return step.backend.forward(q, k, v, kv_cache, step.meta, scale)


@_attention_op.register_fake
def _attention_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
