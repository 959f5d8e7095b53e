"""Configuration shared by the engine, the services and the CLI: one place for every knob.

Defaults work on a laptop (CPU, a few GiB for the KV cache). This module only holds data and
validates it; it must never import torch or touch a device.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _arg(default, type_, help_, choices=None):
    """A config field that also describes its command-line flag."""
    return field(default=default, metadata={"type": type_, "help": help_, "choices": choices})


def cache_dir() -> Path:
    """Where Folio keeps prepared models; FOLIO_CACHE_DIR overrides it."""
    root = os.environ.get("FOLIO_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "folio"
    )
    return Path(root)


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance."""

    model: str | None = _arg(None, str, "a local Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    dtype: str = _arg("auto", str, "weights and activations; auto = bfloat16", choices=DTYPES)
    device: str = _arg("cpu", str, "torch device")
    block_size: int = _arg(16, int, "tokens per KV cache block (a power of two)")
    kv_cache_memory_bytes: int = _arg(2 * 1024**3, int, "memory budget of the KV cache pool")
    num_kv_blocks: int | None = _arg(None, int, "KV pool size in blocks (overrides the memory budget)")
    max_num_batched_tokens: int = _arg(2048, int, "token budget of one engine step")
    max_num_seqs: int = _arg(128, int, "most requests running at once")
    max_waiting_requests: int = _arg(1024, int, "bound of the waiting queue; beyond it requests are refused")
    max_model_len: int | None = _arg(None, int, "context length (default: the model's, capped by the KV pool)")
    scheduling_policy: str = _arg("fcfs", str, "which waiting request runs first", choices=SCHEDULING_POLICIES)
    enable_prefix_caching: bool = _arg(True, bool, "reuse KV blocks of identical prompt prefixes")
    attention_backend: str = _arg("auto", str, "auto = triton on CUDA, torch otherwise", choices=ATTENTION_BACKENDS)
    enable_cuda_graphs: bool = _arg(True, bool, "replay captured CUDA graphs for decode steps (GPU, triton backend)")
    num_threads: int | None = _arg(None, int, "CPU threads for torch (default: torch's choice)")
    seed: int = _arg(0, int, "seed of the generator shared by unseeded sampled requests")

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


# Where the services listen by default: loopback only, one port each; `folio serve` and
# docker compose use the same numbers.
DEFAULT_HOST = "127.0.0.1"
ENGINE_PORT = 50051
TOKENIZER_PORT = 50052
GATEWAY_GRPC_PORT = 50053
HTTP_PORT = 8000
# How long a stopping service lets requests in flight finish.
DRAIN_SECONDS = 30.0


def add_service_args(parser: argparse.ArgumentParser, port: int) -> None:
    """--host, --port and --drain-seconds of one gRPC service."""
    group = parser.add_argument_group("service")
    group.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    group.add_argument("--port", type=int, default=port, help="gRPC port (0 picks a free one)")
    group.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                       help="on SIGTERM / Ctrl-C, how long requests in flight may finish")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-num-seqs ...); booleans get --no-... too."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        if meta["type"] is bool:
            group.add_argument(flag, default=f.default, action=argparse.BooleanOptionalAction, help=meta["help"])
        else:
            group.add_argument(flag, default=f.default, type=meta["type"], choices=meta["choices"], help=meta["help"])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def engine_args_from_config(config: EngineConfig) -> list[str]:
    """The inverse of add_engine_args: flags that parse back into `config` (for child processes)."""
    args: list[str] = []
    for f in fields(EngineConfig):
        value = getattr(config, f.name)
        flag = f.name.replace("_", "-")
        if f.metadata["type"] is bool:
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", str(value)]
    return args
