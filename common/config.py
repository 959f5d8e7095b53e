"""Configuration shared by the engine, the services and the CLI: one place for every knob.

Defaults work on a laptop (CPU, a few GiB for the KV cache). This module only holds data and
validates it; it must never import torch or touch a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def cache_dir() -> Path:
    """Where Folio keeps prepared models; FOLIO_CACHE_DIR overrides it."""
    root = os.environ.get("FOLIO_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "folio"
    )
    return Path(root)


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance."""

    # A local Hugging Face directory; None means the default model (prepared on first use).
    model: str | None = None
    # "auto" is bfloat16 on CPU (bf16 matmul is ~5x fp32 there) and on GPU.
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    # The KV pool is sized from this budget unless num_kv_blocks is given.
    kv_cache_memory_bytes: int = 2 * 1024**3
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_waiting_requests: int = 1024
    # None: the model's own context length.
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    # CPU threads for torch; None leaves torch's default.
    num_threads: int | None = None
    # Seeds the generator that unseeded sampled requests share.
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
        )
        require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            f"block_size must be a power of two, got {self.block_size}",
        )
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        require(
            self.max_waiting_requests >= 1,
            f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}",
        )
        require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}",
        )
        require(
            self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}",
        )
