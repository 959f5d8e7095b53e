"""Keeping what a service process loaded out of the cyclic garbage collector's way.

A service loads once (modules, the model's compiled programs and torch graphs, the tokenizer's
vocabulary: about a million Python objects in the engine) and then serves for days. Every full
(generation 2) collection would traverse all of them again: 0.3-0.5 s on a 2-core VM, during
which the engine takes no step and every stream stalls. `freeze_loaded_heap` moves what is alive
once a phase that made long-lived objects ends into the collector's permanent generation, so
later collections look only at what serving made since.

Frozen objects' cycles are never collected, so only a process that keeps what it loaded for its
whole life may freeze: the entry point of a service process says so (`own_process_heap`), and
elsewhere (a library's caller, a test process running services in threads) freezing does
nothing. Never freeze per request or per step: at the end of start-up, and when a background
load adds a large long-lived set (compiled programs), nowhere else.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

_owned = False


def own_process_heap() -> None:
    """This process is one service's own, for its whole life: freeze_loaded_heap freezes."""
    global _owned
    _owned = True


def freeze_loaded_heap(what: str, collect: bool = True) -> None:
    """Freeze every object alive now (`what` loaded them: for the log), in a process that owns
    its heap. With `collect`, first free what loading left as garbage in cycles (one full
    collection, a fraction of a second: before the service says it is serving); a caller that
    requests wait on passes False (loading's cyclic garbage then stays allocated)."""
    if not _owned:
        return
    started = time.perf_counter()
    if collect:
        gc.collect()
    gc.freeze()
    logger.info(
        "%s: %d objects moved out of the garbage collector's scans in %.2f s",
        what,
        gc.get_freeze_count(),
        time.perf_counter() - started,
    )
