"""The event loop every Folio service process runs on: uvloop (libuv) where it is installed,
asyncio's own loop otherwise.

uvloop makes each loop wake-up, callback and socket write cheaper; the gateway pays those per
token (a queue hand-off and an SSE write per streamed chunk, gRPC completions per engine step),
and its CPU per output token fell by about a fifth with it (README, "Benchmark"). It never
changes what a coroutine computes, only how fast the loop runs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop
except ImportError:  # not on this platform (uvloop has no Windows build)
    uvloop = None  # type: ignore[assignment]


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the fastest loop available."""
    if uvloop is None:
        return asyncio.run(main)
    return uvloop.run(main)
