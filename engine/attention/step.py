"""The step being run, as the model's layers see it: the backend, the step's metadata and the
KV caches their attention uses, set once per forward instead of passed through every layer.

Attention is also one opaque op here (torch.ops.folio.attention), so that torch.compile traces
the layers around it and leaves the attention itself, which plans each step from host-side
lengths, to the backend (engine.compiled_decode); a backend with a C++ op of its own for
decode-only steps has the compiled programs call that one instead. Either op names its layer's
cache by index, so the caches are no inputs of a compiled program: its code does not depend on
the pool's size.
The layers call `attention` whatever runs them; eagerly it goes straight to the backend. This
module never computes attention itself.
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
    kv_caches: list[torch.Tensor]


# Per thread: an engine runs its steps in one thread, and two engines in one process (tests,
# several LLM objects) each in their own.
_current = threading.local()


@contextmanager
def running_step(
    backend: AttentionBackend, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
) -> Iterator[None]:
    """The layers' attention reads this step's metadata and caches while the block runs."""
    backend.prepare(meta)
    _current.step = Step(backend, meta, kv_caches)
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
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Layer `layer`'s attention in the running step (AttentionBackend.forward's contract, over
    that layer's KV cache and its KV group's tables, under its sliding window if any, with its
    attention sinks if any). A compiled program calls the backend's own decode-step op where it
    has one for q (no Python in between), else folio::attention."""
    if torch.compiler.is_compiling():
        op = backend.decode_step_op(q)
        if op is not None:
            return op(q, k, v, layer, scale, window or 0, sinks)
        return torch.ops.folio.attention(q, k, v, layer, scale, window or 0, sinks)
    return _attend(q, k, v, layer, scale, window, sinks)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    step = _current_step()
    meta = step.meta.for_layer(layer)
    return step.backend.forward(q, k, v, step.kv_caches[layer], meta, scale, window, sinks)


# The op writes the step's K/V into a cache it reaches through the running step, which no
# compiled program sees; declaring no mutation is safe because every layer's attention depends
# on the previous layer's output, so the compiled code keeps them in order.
@torch.library.custom_op("folio::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return _attend(q, k, v, layer, scale, window or None, sinks)  # 0: no window


@_attention_op.register_fake
def _attention_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
