"""The KV pool's dtype as torch's ops meet it (--kv-cache-dtype): values rounded as the cache
keeps them, and the indexed copies torch has no 8-bit float kernel for done on their bytes.

Conversions and views only: choosing the pool's dtype is engine.model_runner's
(resolve_kv_dtype), and Folio's CPU kernels convert for themselves, with the same rounding.
"""

from __future__ import annotations

import torch


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` keeps it: rounded to nearest even, an 8-bit float's values past
    its largest finite one saturating to it (torch gives float8_e5m2 infinity there)."""
    if dtype.itemsize == 1:
        largest = torch.finfo(dtype).max
        x = x.clamp(-largest, largest)
    return x.to(dtype)


def copyable(x: torch.Tensor) -> torch.Tensor:
    """`x`, or for a one-byte float its bytes (the same strides): index_copy_ has no float8
    kernel on the CPU."""
    return x.view(torch.uint8) if x.dtype.itemsize == 1 and x.is_floating_point() else x
