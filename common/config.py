"""Configuration shared by the engine, the services and the CLI: one place for every knob.

Defaults work on a laptop (CPU, a few GiB for the KV cache). This module only holds data and
validates it; it must never import torch or touch a device.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4")
ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin")
DEFAULT_HOST = "127.0.0.1"


def _arg(
    default: Any, type_: Callable[[str], Any], help_: str, choices: Sequence[Any] | None = None
) -> Any:
    """A config field that also describes its command-line flag."""
    return field(default=default, metadata={"type": type_, "help": help_, "choices": choices})


def cache_dir() -> Path:
    """Where Folio keeps prepared models; FOLIO_CACHE_DIR overrides it."""
    root = os.environ.get("FOLIO_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "folio"
    )
    return Path(root)


def default_step_cost_path() -> Path:
    """Where `folio bench profile` writes the step cost model simulated engines read."""
    return cache_dir() / "step_cost.json"


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance."""

    model: str | None = _arg(
        None, str, "a local Hugging Face model directory (default: SmolLM2-135M-Instruct)"
    )
    dtype: str = _arg(
        "auto",
        str,
        "weights and activations; auto = bfloat16 where the device computes it natively, else "
        "float32 (float32 on a CPU with --quantization, whose kernels take it)",
        choices=DTYPES,
    )
    device: str = _arg("cpu", str, "torch device")
    quantization: str | None = _arg(
        None,
        str,
        "weight-only quantization of the linear layers on the CPU: int8 (per output channel) or "
        "int4 (groups of 32, GGUF Q4_1's scheme); default off",
        choices=QUANTIZATIONS,
    )
    block_size: int = _arg(16, int, "tokens per KV cache block (a power of two)")
    kv_cache_memory_bytes: int = _arg(2 * 1024**3, int, "memory budget of the KV cache pool")
    num_kv_blocks: int | None = _arg(
        None, int, "KV pool size in blocks (overrides the memory budget)"
    )
    max_num_batched_tokens: int = _arg(2048, int, "token budget of one engine step")
    max_num_seqs: int = _arg(128, int, "most requests running at once")
    max_waiting_requests: int = _arg(
        1024, int, "bound of the waiting queue; beyond it requests are refused"
    )
    max_model_len: int | None = _arg(
        None, int, "context length (default: the model's, capped by the KV pool)"
    )
    scheduling_policy: str = _arg(
        "fcfs", str, "which waiting request runs first", choices=SCHEDULING_POLICIES
    )
    enable_prefix_caching: bool = _arg(True, bool, "reuse KV blocks of identical prompt prefixes")
    attention_backend: str = _arg(
        "auto", str, "auto = triton on CUDA, torch otherwise", choices=ATTENTION_BACKENDS
    )
    enable_cuda_graphs: bool = _arg(
        True, bool, "replay captured CUDA graphs for decode steps (GPU, triton backend)"
    )
    enforce_eager: bool = _arg(
        os.environ.get("FOLIO_ENFORCE_EAGER") == "1",
        bool,
        "run every step eagerly: no torch.compile of decode steps on the CPU, no CUDA graphs "
        "(FOLIO_ENFORCE_EAGER=1 makes this the default)",
    )
    num_threads: int | None = _arg(None, int, "CPU threads for torch (default: torch's choice)")
    seed: int = _arg(0, int, "seed of the generator shared by unseeded sampled requests")
    tensor_parallel_size: int = _arg(
        1, int, "processes (ranks) the model is sharded over; rank 0 is the engine itself"
    )
    kv_events_replay_batches: int = _arg(
        1024,
        int,
        "KV-cache event batches (about one per step that cached or evicted blocks) kept for "
        "subscribers that reconnect; one whose gap is older gets a snapshot instead",
    )
    master_addr: str = _arg(
        DEFAULT_HOST,
        str,
        "address the tensor-parallel rendezvous and rank 0's sockets bind to (no "
        "authentication: keep it on a private network)",
    )
    master_port: int = _arg(0, int, "port of the tensor-parallel rendezvous (0 picks a free one)")
    external_workers: bool = _arg(
        False,
        bool,
        "wait for workers started with `folio engine-worker` instead of starting them",
    )

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        require(
            self.quantization is None or self.device == "cpu",
            f"quantization runs on the CPU only, got device {self.device!r}",
        )
        require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, "
            f"got {self.attention_backend!r}",
        )
        require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
            f"got {self.scheduling_policy!r}",
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
        require(
            self.kv_events_replay_batches >= 1,
            f"kv_events_replay_batches must be >= 1, got {self.kv_events_replay_batches}",
        )
        require(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
        )
        require(
            not self.external_workers or (self.tensor_parallel_size > 1 and self.master_port > 0),
            "external_workers needs tensor_parallel_size > 1 and a master_port the workers "
            f"know (got tensor_parallel_size {self.tensor_parallel_size}, "
            f"master_port {self.master_port})",
        )


# Where the services listen by default: loopback only, one port each; `folio serve` and
# docker compose use the same numbers.
ENGINE_PORT = 50051
TOKENIZER_PORT = 50052
GATEWAY_GRPC_PORT = 50053
HTTP_PORT = 8000
# How long a stopping service lets requests in flight finish.
DRAIN_SECONDS = 30.0
# The largest HTTP request body the gateway reads (413 beyond). Room for a full context of
# text or token ids (its tokens travel to the tokenizer well inside GRPC_MAX_MESSAGE_BYTES),
# and a client must not make the gateway buffer without bound.
MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# The largest gRPC message any Folio server or client sends or receives (gRPC's default is
# 4 MiB). The largest real messages are a whole prompt and, from the tokenizer, the ids and
# strings of a MAX_REQUEST_BODY_BYTES body's tokens (about twice its size): well inside.
GRPC_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
GRPC_MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
]
# Secrets come from the environment, never from flags that `folio serve` passes on: a command
# line is visible to every user of the machine (ps). FOLIO_INTERNAL_TOKEN, when set, is the
# token the engine and tokenizer require of their callers (the gateway sends it);
# FOLIO_API_KEYS is a comma-separated list of the gateway's API keys.
INTERNAL_TOKEN_ENV = "FOLIO_INTERNAL_TOKEN"
API_KEYS_ENV = "FOLIO_API_KEYS"
# How long the gateway lets one request run, queueing and generation included.
REQUEST_TIMEOUT_SECONDS = 600.0
# How often the gateway's dashboard feed (/dashboard/feed) sends a sample of the engine's load.
DASHBOARD_FEED_INTERVAL_SECONDS = 0.5
# How often `folio serve` restarts a service that keeps dying before it gives up.
MAX_RESTARTS = 5
# Entries of oneDNN's two kernel caches (its primitive cache and PyTorch's ideep LRU cache) in
# an engine on CPU; their defaults are 1024 each. Every new batch shape compiles and caches
# kernels, so with the defaults the engine's memory grew by hundreds of MiB under varied load
# and kept growing for as long as new shapes came; at 64 it is flat after a few steps, and
# `folio bench offline` runs as fast (within its noise). An environment value set by the
# operator (ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY) wins.
CPU_KERNEL_CACHE_CAPACITY = 64
# Tensor parallelism: each worker rank bumps a counter in the rendezvous store this often;
# rank 0 declares a worker dead when its counter has not moved for HEARTBEAT_TIMEOUT_SECONDS
# (or at once when a worker it started exits). Liveness never comes from a collective timing
# out: an idle group waits in its collectives for as long as it stays idle.
TP_HEARTBEAT_SECONDS = 0.5
TP_HEARTBEAT_TIMEOUT_SECONDS = 10.0
# How long a worker waits for the engine's rendezvous before trying again, and how long a
# failed engine whose step is stuck in a collective gets to fail its requests before it exits.
TP_RENDEZVOUS_RETRY_SECONDS = 1.0
# A restarted engine's fixed rendezvous port may be held a moment by its predecessor's sockets.
TP_BIND_RETRY_SECONDS = 30.0
TP_FAILURE_EXIT_SECONDS = 5.0
# gRPC channel options of the clients of the internal services: a restarted service is found
# again within a second, not after gRPC's default reconnect back-off (up to two minutes).
RECONNECT_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def add_service_args(parser: argparse.ArgumentParser, port: int) -> None:
    """--host, --port and --drain-seconds of one gRPC service."""
    group = parser.add_argument_group("service")
    group.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    group.add_argument("--port", type=int, default=port, help="gRPC port (0 picks a free one)")
    group.add_argument(
        "--drain-seconds",
        type=float,
        default=DRAIN_SECONDS,
        help="on SIGTERM / Ctrl-C, how long requests in flight may finish",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-num-seqs ...); booleans get --no-... too."""
    _add_config_args(parser.add_argument_group("engine"), EngineConfig)


def _add_config_args(group: argparse._ActionsContainer, config_type: type) -> None:
    """One flag per field of `config_type` declared with _arg."""
    for f in fields(config_type):
        if "type" not in f.metadata:
            continue  # not a flag
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        if meta["type"] is bool:
            group.add_argument(
                flag, default=f.default, action=argparse.BooleanOptionalAction, help=meta["help"]
            )
        else:
            group.add_argument(
                flag,
                default=f.default,
                type=meta["type"],
                choices=meta["choices"],
                help=meta["help"],
            )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def engine_args_from_config(config: EngineConfig) -> list[str]:
    """The inverse of add_engine_args: flags that parse back into `config` (for child processes)."""
    return _config_args(config)


def _config_args(config: Any) -> list[str]:
    """The flags of a config's _arg fields that parse back into their values."""
    args: list[str] = []
    for f in fields(config):
        if "type" not in f.metadata:
            continue
        value = getattr(config, f.name)
        flag = f.name.replace("_", "-")
        if f.metadata["type"] is bool:
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", str(value)]
    return args


# The tool-call parsers the gateway has (gateway/tools/parsers.py), by their vLLM names.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class GatewayConfig:
    """Who may call the gateway, how often and for how long."""

    # From --api-key, FOLIO_API_KEYS and --api-key-file (common.auth.load_api_keys); empty: no
    # authentication. Never printed: repr leaves them out.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    protect_health_metrics: bool = _arg(
        False,
        bool,
        "require an API key for /health, /metrics, what SMG polls (/server_info, /model_info, "
        "/v1/loads) and gRPC health too (default: open, for probes, scrapers and routers)",
    )
    rate_limit_rps: float | None = _arg(
        None,
        float,
        "requests per second per API key (per client address without keys); default: unlimited",
    )
    rate_limit_tpm: int | None = _arg(
        None,
        int,
        "tokens per minute per API key (per client address without keys): prompt "
        "plus max_tokens, what a sequence did not generate given back; default: "
        "unlimited",
    )
    webui: bool = _arg(
        True,
        bool,
        "serve the web pages: the playground at / and the live dashboard at /dashboard "
        "(--no-webui: the API only)",
    )
    request_timeout: float = _arg(
        REQUEST_TIMEOUT_SECONDS,
        float,
        "seconds one request may take, queueing included; "
        "then it is aborted (HTTP 504, gRPC DEADLINE_EXCEEDED)",
    )

    routing_policy: str = _arg(
        "cache_aware",
        str,
        "with several engine replicas, which one a request goes to: the one holding most of "
        "its prompt's prefix in its KV cache unless overloaded, the least loaded, or each in turn",
        choices=ROUTING_POLICIES,
    )
    tool_call_parser: str | None = _arg(
        None,
        str,
        "how tool calls are read from the model's output, named as vLLM names its parsers "
        "(the chat template must know tools); default: the format the chat template teaches, "
        "else a generic format in a system message",
        choices=TOOL_CALL_PARSERS,
    )

    def __post_init__(self) -> None:
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(
                f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        for name in ("rate_limit_rps", "rate_limit_tpm"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    """The gateway's auth, limit and timeout flags (GatewayConfig)."""
    group = parser.add_argument_group("auth and limits")
    group.add_argument(
        "--api-key",
        action="append",
        default=[],
        dest="api_key",
        help="an API key clients must send (Authorization: Bearer KEY); repeatable. "
        f"Visible in ps: prefer {API_KEYS_ENV} (comma-separated) or "
        "--api-key-file",
    )
    group.add_argument(
        "--api-key-file",
        default=None,
        help="a file of API keys, one per line (blank lines and # comments skipped)",
    )
    _add_config_args(group, GatewayConfig)


def gateway_config_from_args(args: argparse.Namespace, api_keys: tuple[str, ...]) -> GatewayConfig:
    return GatewayConfig(
        api_keys=api_keys,
        **{f.name: getattr(args, f.name) for f in fields(GatewayConfig) if "type" in f.metadata},
    )


def gateway_args_from_config(config: GatewayConfig) -> list[str]:
    """Flags that parse back into `config`, except its keys (they travel in API_KEYS_ENV)."""
    return _config_args(config)
