"""Configuration shared by the engine, the services and the CLI: every command's config tree.

Each config is a dataclass whose fields are the flags of the commands that use it, declared once
with common.flags.flag (help, default, choices): the engine's knobs (EngineConfig), the gateway's
policies (GatewayConfig), where a service listens (ListenConfig), and the tree of each service
command (`folio tokenizer`, `folio engine`, `folio gateway`) that `folio serve` hands its
children as JSON. Ports, limits and other constants several processes share live here too; a
constant one module uses lives in that module. Defaults work on a laptop (CPU, a few GiB for the
KV cache). This module only holds data and validates it; it must never import torch or touch a
device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.flags import check_choices, command_line, flag, from_args
from common.generation_config import check_setting, parse_override
from common.speculative import SpeculativeConfig

ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's names; fp8 is e4m3 (e4m3fn: no infinities), as in vLLM, with no scale (vLLM's 1.0).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
DECODE_COMPILE = ("auto", "startup", "background")
KV_OFFLOAD_FORMATS = ("auto", "int8", "native")
QUANTIZATIONS = ("int8", "int4")
ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin")
# generate: text generation (and embeddings too); pooling: embeddings only; auto: pooling for a
# sentence-transformers model (modules.json in its directory), else generate.
RUNNERS = ("auto", "generate", "pooling")
DEFAULT_HOST = "127.0.0.1"
# Where the services listen by default: loopback only, one port each; `folio serve` and
# docker compose use the same numbers.
ENGINE_PORT = 50051
TOKENIZER_PORT = 50052
GATEWAY_GRPC_PORT = 50053
# The engine's Generate socket, beside its gRPC port (`folio serve` gives its engines free ones).
GENERATE_SOCKET_PORT = 50054
HTTP_PORT = 8000
# How long a stopping service lets requests in flight finish.
DRAIN_SECONDS = 30.0


def cache_dir() -> Path:
    """Where Folio keeps prepared models; FOLIO_CACHE_DIR overrides it."""
    root = os.environ.get("FOLIO_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "folio"
    )
    return Path(root)


def default_batch_dir() -> Path:
    """Where the gateway keeps its batch jobs unless --batch-dir says otherwise."""
    return cache_dir() / "batches"


def default_step_cost_path() -> Path:
    """Where `folio bench profile` writes the step cost model that engines (real and simulated)
    start from; FOLIO_STEP_COST overrides it (a path with no profile: the built-in model)."""
    return Path(os.environ.get("FOLIO_STEP_COST") or cache_dir() / "step_cost.json")


def _model_flag() -> Any:
    return flag(
        None,
        "a local Hugging Face model directory or Llama GGUF file (default: SmolLM2-135M-Instruct)",
    )


def lora_module(spec: str) -> tuple[str, str]:
    """One --lora-modules value, NAME=PATH or vLLM's JSON {"name": ..., "path": ...,
    "base_model_name": ...} (the base model's name is only said: an adapter's parent is the
    served model): its name and path. ValueError naming the forms it takes."""
    forms = 'lora_modules takes NAME=PATH or {"name": NAME, "path": PATH}'
    if spec.lstrip().startswith("{"):
        try:
            value = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{forms}; {spec!r} is not JSON: {exc}") from None
        keys = {"name", "path", "base_model_name"}
        if not isinstance(value, dict) or set(value) - keys:
            raise ValueError(f"{forms} (keys: {', '.join(sorted(keys))}), got {spec!r}")
        name, path = value.get("name"), value.get("path")
    else:
        name, _, path = spec.partition("=")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise ValueError(f"{forms}, got {spec!r}")
    return name, path


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance."""

    model: str | None = _model_flag()
    runner: str = flag(
        "auto",
        "what the model serves: generate (text, and embeddings too), pooling (embeddings only: "
        "generation requests are refused); auto = pooling for a sentence-transformers model "
        "(modules.json in its directory), else generate",
        choices=RUNNERS,
    )
    dtype: str = flag(
        "auto",
        "weights and activations; auto = bfloat16 where the device computes it natively, else "
        "float32 (float32 on a CPU with --quantization, whose kernels take it)",
        choices=DTYPES,
    )
    device: str = flag("cpu", "torch device")
    quantization: str | None = flag(
        None,
        "weight-only quantization of the linear layers on the CPU: int8 (per output channel) or "
        "int4 (groups of 32, GGUF Q4_1's scheme); default off",
        choices=QUANTIZATIONS,
    )
    block_size: int = flag(16, "tokens per KV cache block (a power of two)")
    kv_cache_memory_bytes: int = flag(2 * 1024**3, "memory budget of the KV cache pool")
    kv_cache_dtype: str = flag(
        "auto",
        "the KV cache's dtype; auto = the activations' (--dtype); bfloat16 under float32 "
        "activations (CPU only) halves the pool's bytes a token (twice the tokens in "
        "--kv-cache-memory-bytes, half the bytes a decode step's attention reads), its K and V "
        "rounded to bfloat16; fp8 (= fp8_e4m3) or fp8_e5m2 (CPU only) a quarter of float32's "
        "bytes, K and V rounded to 8-bit floats, saturating at their largest finite value "
        "(docs/kv_tiers.md)",
        choices=KV_CACHE_DTYPES,
    )
    num_kv_blocks: int | None = flag(
        None, "KV pool size in blocks (default: as many as --kv-cache-memory-bytes holds)"
    )
    max_num_batched_tokens: int = flag(2048, "token budget of one engine step")
    max_num_seqs: int = flag(128, "most requests running at once")
    max_waiting_requests: int = flag(
        1024, "bound of the waiting queue; beyond it requests are refused"
    )
    stream_interval: int = flag(
        1,
        "tokens a request gathers before its outputs leave the engine (its first token and its "
        "end leave at once): 1 streams every step's token; more cuts the per-message work of the "
        "engine service, the gateway and the client (CPU they would take from the engine's "
        "cores) for a stream that arrives in bursts of that many tokens",
    )
    max_model_len: int | None = flag(
        None, "context length (default: the model's, capped by the KV pool)"
    )
    scheduling_policy: str = flag(
        "fcfs",
        "which waiting request runs first: by arrival, by priority, or by tenant (fair: weighted "
        "fair shares of computed tokens between the gateway's tenants); within each, earliest "
        "deadline first",
        choices=SCHEDULING_POLICIES,
    )
    enable_prefix_caching: bool = flag(True, "reuse KV blocks of identical prompt prefixes")
    kv_offload_gib: float = flag(
        0.0,
        "host tier under the KV pool, in GiB: cached blocks evicted from the pool are kept "
        "there and loaded back on a prefix hit (docs/kv_tiers.md); 0 = off",
    )
    kv_offload_format: str = flag(
        "auto",
        "the host tier's format: int8 (per-block scales, about 1/4 of float32), native (the "
        "pool's dtype, exact; pinned memory on CUDA); auto = int8 on the CPU, native on a GPU",
        choices=KV_OFFLOAD_FORMATS,
    )
    kv_cache_dir: str | None = flag(
        None,
        "disk tier: cached KV blocks written to files here, found again after a restart by an "
        "engine of the same model, dtype, block size, TP layout and quantization; default off",
    )
    kv_cache_dir_gib: float = flag(
        8.0, "bound of the disk tier in GiB (the oldest files are deleted first)"
    )
    attention_backend: str = flag(
        "auto", "auto = triton on CUDA, torch otherwise", choices=ATTENTION_BACKENDS
    )
    enable_cuda_graphs: bool = flag(
        True, "replay captured CUDA graphs for decode steps (GPU, triton backend)"
    )
    enforce_eager: bool = flag(
        os.environ.get("FOLIO_ENFORCE_EAGER") == "1",
        "run every step eagerly: no torch.compile of decode steps on the CPU, no CUDA graphs "
        "(FOLIO_ENFORCE_EAGER=1 makes this the default)",
    )
    decode_compile: str = flag(
        "auto",
        "when compiled decode steps (CPU) get ready: startup = before the engine serves; "
        "background = it serves eagerly meanwhile and switches over; auto = background in "
        "folio engine and folio serve, startup in the offline LLM",
        choices=DECODE_COMPILE,
    )
    num_threads: int | None = flag(None, "CPU threads for torch (default: torch's choice)")
    seed: int = flag(0, "seed of the generator shared by unseeded sampled requests")
    tensor_parallel_size: int = flag(
        1, "processes (ranks) the model is sharded over; rank 0 is the engine itself"
    )
    enable_expert_parallel: bool = flag(
        False,
        "with tensor parallelism, a mixture of experts' ranks hold whole experts (an even share "
        "each) instead of a slice of every expert",
    )
    lora_modules: tuple[str, ...] = flag(
        (),
        "a LoRA adapter in PEFT's format served beside the base model, as NAME=PATH or vLLM's "
        'JSON {"name": ..., "path": ...} (a request picks it by "model": NAME); several '
        "(docs/lora.md)",
    )
    max_loras: int = flag(
        4, "LoRA adapters resident in the model's slots at once; more are swapped from host memory"
    )
    max_lora_rank: int = flag(16, "the largest LoRA rank served (the slots' width)")
    lora_root: str | None = flag(
        None,
        "the directory runtime LoRA loads (POST /v1/load_lora_adapter) must resolve inside, "
        "symlinks followed; default: none, adapters load at start-up only",
    )
    lora_runtime_updates: bool = flag(
        True, "allow loading and unloading LoRA adapters at run time (needs --lora-root)"
    )
    kv_events_replay_batches: int = flag(
        1024,
        "KV-cache event batches (about one per step that cached or evicted blocks) kept for "
        "subscribers that reconnect; one whose gap is older gets a snapshot instead",
    )
    master_addr: str = flag(
        DEFAULT_HOST,
        "address the tensor-parallel rendezvous and rank 0's sockets bind to (no "
        "authentication: keep it on a private network)",
    )
    master_port: int = flag(0, "port of the tensor-parallel rendezvous (0 picks a free one)")
    external_workers: bool = flag(
        False,
        "wait for workers started with `folio engine-worker` instead of starting them",
    )
    speculative_config: str | None = flag(
        None,
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "suffix" or "draft_model" '
        '(with "model": DIR), "num_speculative_tokens": 4, ...} '
        "(docs/speculative_decoding.md); default off",
    )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config parsed (checked already when the config was built)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_json(self.speculative_config)

    @property
    def lora_enabled(self) -> bool:
        """Whether the model gets LoRA slots: adapters at start-up or a root to load from."""
        return bool(self.lora_modules) or self.lora_root is not None

    def __post_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check_choices(self)
        require(
            self.quantization is None or self.device == "cpu",
            f"quantization runs on the CPU only, got device {self.device!r}",
        )
        require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            f"block_size must be a power of two, got {self.block_size}",
        )
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for module in self.lora_modules:
            lora_module(module)
        require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        require(
            self.max_waiting_requests >= 1,
            f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}",
        )
        require(
            self.stream_interval >= 1,
            f"stream_interval must be >= 1, got {self.stream_interval}",
        )
        require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}",
        )
        require(
            self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}",
        )
        require(self.kv_offload_gib >= 0, f"kv_offload_gib must be >= 0, got {self.kv_offload_gib}")
        require(
            self.kv_cache_dir_gib > 0,
            f"kv_cache_dir_gib must be > 0, got {self.kv_cache_dir_gib}",
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
        _ = self.speculative  # a bad --speculative-config is refused here, naming its key


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
# How often the gateway's dashboard feed (/dashboard/feed) sends a sample of the engine's load.
DASHBOARD_FEED_INTERVAL_SECONDS = 0.5
# gRPC channel options of the clients of the internal services: a restarted service is found
# again within a second, not after gRPC's default reconnect back-off (up to two minutes).
RECONNECT_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class ListenConfig:
    """Where a service listens and how long it drains."""

    host: str = flag(
        DEFAULT_HOST,
        "address to listen on (folio serve: the gateway's; the engine and the tokenizer stay on "
        "127.0.0.1)",
    )
    port: int = flag(0, "port to listen on (0 picks a free one)")
    drain_seconds: float = flag(
        DRAIN_SECONDS, "on SIGTERM / Ctrl-C, how long requests in flight may finish"
    )


@dataclass
class TokenizerOptions:
    """What the tokenizer service lays over the model's own files: the chat template, and the
    sampling defaults of the OpenAI APIs. Checked when made, so that a bad one stops `folio
    serve` before any service starts, not the first chat request."""

    chat_template: str | None = flag(
        None,
        "a Jinja chat template, or a file holding one, for chat requests (vLLM's "
        "--chat-template; default: the model's own)",
    )
    generation_config: str = flag(
        "auto",
        "the sampling defaults of the OpenAI APIs (vLLM's --generation-config): auto = the "
        "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty "
        "where a request leaves them unset; max_new_tokens caps every request), folio (or vllm) "
        "= none, or a directory holding a generation_config.json",
    )
    override_generation_config: str | None = flag(
        None,
        "a JSON object of sampling defaults laid over --generation-config's (vLLM's flag), "
        'e.g. \'{"temperature": 0.7, "max_new_tokens": 512}\'; keys: temperature, top_p, '
        "top_k, min_p, repetition_penalty, max_new_tokens; default: none",
    )

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            from common.tokenizer import read_chat_template  # jinja2: only when one is given

            read_chat_template(self.chat_template)
        check_setting(self.generation_config)
        parse_override(self.override_generation_config)


@dataclass
class TokenizerServiceConfig:
    """`folio tokenizer`: the tokenizer gRPC service."""

    model: str | None = _model_flag()
    listen: ListenConfig = field(default_factory=lambda: ListenConfig(port=TOKENIZER_PORT))
    options: TokenizerOptions = field(default_factory=TokenizerOptions)


@dataclass
class StepCostConfig:
    """The simulated engines' step times."""

    # flag returns a dataclasses.field; ruff knows field, not flag, and Path is not a type it
    # knows immutable.
    step_cost: Path = flag(  # noqa: RUF009
        help="with --simulate: the step cost model `folio bench profile` wrote",
        factory=default_step_cost_path,
    )


@dataclass
class SimulationConfig:
    """Simulated engines, for routing studies at scale."""

    simulate: bool = flag(
        False,
        "no model: the real scheduler and KV cache, each step as long as the step cost model "
        "says, placeholder tokens",
    )
    replicas: int = flag(
        1,
        "with --simulate: simulated engines in this process, on consecutive ports from --port "
        "(0: free ones)",
    )
    cost: StepCostConfig = field(default_factory=StepCostConfig)

    def __post_init__(self) -> None:
        if self.replicas != 1 and not self.simulate:
            raise ValueError(
                "--replicas needs --simulate (real replicas: folio serve --engine-replicas N)"
            )


@dataclass
class EngineServiceConfig:
    """`folio engine`: the engine gRPC service."""

    listen: ListenConfig = field(default_factory=lambda: ListenConfig(port=ENGINE_PORT))
    engine: EngineConfig = field(default_factory=EngineConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    generate_socket_port: int = flag(
        GENERATE_SOCKET_PORT,
        "port of the Generate socket, Generate's stream without gRPC's per-message cost, on "
        "the --host address (the gateway uses it when the engine offers it); 0 picks a free "
        "one, -1: none (with --simulate: consecutive ports from it)",
    )

    def __post_init__(self) -> None:
        if not -1 <= self.generate_socket_port <= 65535:
            raise ValueError(
                f"generate_socket_port must be a port (0: a free one) or -1 (none), got "
                f"{self.generate_socket_port}"
            )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return from_args(EngineConfig, args)


def engine_args_from_config(config: EngineConfig) -> list[str]:
    """The engine flags that parse back into `config` (bench starts `folio serve` with them)."""
    return command_line(config)


# The tool-call parsers the gateway has (gateway/openai/tools/parsers.py), by their vLLM names.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "openai")
# How a reasoning model's thinking is told from its answer (gateway/openai/reasoning/); "none"
# leaves it in the answer.
REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss", "none")


@dataclass
class GatewayConfig:
    """Who may call the gateway, how often and for how long."""

    # From --api-key, FOLIO_API_KEYS and --api-key-file (common.auth.load_api_keys); empty: no
    # authentication. Never printed: repr leaves them out.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    protect_health_metrics: bool = flag(
        False,
        "require an API key for /health, /metrics, what SMG polls (/server_info, /model_info, "
        "/v1/loads) and gRPC health too (off: open, for probes, scrapers and routers)",
    )
    rate_limit_rps: float | None = flag(
        None,
        "requests per second per API key (per client address without keys); default: unlimited",
    )
    rate_limit_tpm: int | None = flag(
        None,
        "tokens per minute per API key (per client address without keys): prompt "
        "plus max_tokens, what a sequence did not generate given back; default: "
        "unlimited",
    )
    max_pinned_gib_per_key: float | None = flag(
        None,
        "KV cache an API key's pinned prefixes may hold at once, in GiB (the chat `cache` "
        "extension, Anthropic's cache_control; requests without keys share one bound); past it "
        "a prompt is pinned up to it; default: no bound but the engine's (half its KV pool)",
    )
    webui: bool = flag(
        True,
        "serve the web pages: the playground at / and the live dashboard at /dashboard "
        "(--no-webui: the API only)",
    )
    request_timeout: float = flag(
        600.0,
        "seconds one request may take, queueing included; "
        "then it is aborted (HTTP 504, gRPC DEADLINE_EXCEEDED)",
    )

    trust_tenant_header: bool = flag(
        False,
        "take a request's tenant (its fair share under --scheduling-policy fair) from its "
        "x-tenant header, as a proxy in front names it; default: its API key's tenant= setting, "
        "else the key itself",
    )
    routing_policy: str = flag(
        "cache_aware",
        "with several engine replicas, which one a request goes to: the one holding most of "
        "its prompt's prefix in its KV cache unless overloaded, the least loaded, or each in turn",
        choices=ROUTING_POLICIES,
    )
    tool_call_parser: str | None = flag(
        None,
        "how tool calls are read from the model's output, named as vLLM names its parsers "
        "(the chat template must know tools); default: the format the chat template teaches, "
        "else a generic format in a system message",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = flag(
        None,
        "how a reasoning model's thinking is split from its answer (reasoning_content), named "
        "as vLLM names its parsers (none: never split); default: the format the chat template "
        "shows (<think> or harmony channels), else none",
        choices=REASONING_PARSERS,
    )
    batch_dir: str | None = flag(
        None,
        "directory of the batch jobs' SQLite database (uploaded files, jobs and each line's "
        "result; a restarted gateway resumes its jobs from it); default: batches/ in the Folio "
        "cache (FOLIO_CACHE_DIR)",
    )
    max_upload_mib: float = flag(
        200.0, "largest file POST /v1/files accepts, in MiB (a larger one gets 413)"
    )
    batch_concurrency: int = flag(
        4,
        "lines of batch jobs one gateway process runs at once, each in the engine's batch "
        "lane (behind every interactive request)",
    )
    ssl_keyfile: str | None = flag(
        None,
        "TLS: the private key (PEM) the HTTP API and the gRPC text API serve with, beside "
        "--ssl-certfile; default: plaintext",
    )
    ssl_certfile: str | None = flag(
        None, "TLS: the certificate chain (PEM) for --ssl-keyfile's key; default: plaintext"
    )
    allowed_origins: tuple[str, ...] = flag(
        (),
        "browser origins allowed to call the HTTP API (CORS), e.g. https://app.example.com, "
        "or * for any; several values for several; default: none (same-origin pages only)",
    )

    @property
    def scheme(self) -> str:
        """The HTTP API's: https where it serves TLS."""
        return "http" if self.ssl_certfile is None else "https"

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.max_upload_mib > 0:
            raise ValueError(f"max_upload_mib must be > 0, got {self.max_upload_mib}")
        if self.batch_concurrency < 1:
            raise ValueError(f"batch_concurrency must be >= 1, got {self.batch_concurrency}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: set both, or neither")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")
        if self.ssl_certfile is not None:
            # Loaded here as the servers will load them: a bad PEM or a key that is not the
            # certificate's is named now, not by the gRPC server failing to bind. (ssl only
            # then: every `folio` command imports this module.)
            import ssl

            try:
                # No passphrase: an encrypted key fails here instead of prompting a terminal
                # (the gRPC server takes no passphrase either).
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                    self.ssl_certfile, self.ssl_keyfile, password=""
                )
            except ssl.SSLError as exc:
                # OpenSSL names a mismatch, not a bad (or encrypted) file.
                reason = exc.reason or "not PEM, or a key with a passphrase"
                raise ValueError(
                    f"ssl_keyfile and ssl_certfile do not load as a key and its certificate "
                    f"chain: {reason}"
                ) from None
        for name in ("rate_limit_rps", "rate_limit_tpm"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        pinned = self.max_pinned_gib_per_key
        if pinned is not None and not (pinned >= 0 and math.isfinite(pinned)):
            raise ValueError(f"--max-pinned-gib-per-key must be a number >= 0, got {pinned}")
        for origin in self.allowed_origins:
            # A browser's Origin header: scheme and host (and port), no path. A value that is not
            # one would never match, and CORS would fail without a word.
            if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
                hint = " (vLLM's JSON list: give each origin as a value of its own)"
                raise ValueError(
                    f"allowed_origins takes * or origins like https://app.example.com, got "
                    f"{origin!r}{hint if origin.startswith('[') else ''}"
                )


@dataclass
class ApiKeySources:
    """Where the gateway's API keys come from, besides FOLIO_API_KEYS."""

    api_key: tuple[str, ...] = flag(
        (),
        "an API key clients must send (Authorization: Bearer KEY); repeatable. Visible in ps: "
        f"prefer {API_KEYS_ENV} (comma-separated) or --api-key-file",
    )
    api_key_file: str | None = flag(
        None,
        "a file of API keys, one per line (blank lines and # comments skipped), each optionally "
        "followed by tenant=NAME weight=W slo_ttft_ms=MS slo_total_ms=MS; default: none",
    )


@dataclass
class GatewayFrontConfig:
    """The gateway as its clients see it."""

    listen: ListenConfig = field(default_factory=lambda: ListenConfig(port=HTTP_PORT))
    grpc_port: int = flag(
        GATEWAY_GRPC_PORT, "port of the gateway's gRPC text API (0 picks a free one)"
    )
    served_model_name: tuple[str, ...] = flag(
        (),
        "the model name clients use (default: the model directory's name); repeat it for "
        "other names of the same model: a request may use any, its answer says the one it used, "
        "and the first is the default",
    )
    keys: ApiKeySources = field(default_factory=ApiKeySources)
    policy: GatewayConfig = field(default_factory=GatewayConfig)


@dataclass
class GatewayServerConfig:
    """`folio gateway`: the HTTP gateway and its gRPC text API, in front of the services."""

    front: GatewayFrontConfig = field(default_factory=GatewayFrontConfig)
    engine_address: tuple[str, ...] = flag(
        (f"{DEFAULT_HOST}:{ENGINE_PORT}",),
        "HOST:PORT of the engine service; repeat it for each engine replica (the gateway routes "
        "between them by --routing-policy)",
    )
    tokenizer_address: str = flag(
        f"{DEFAULT_HOST}:{TOKENIZER_PORT}", "HOST:PORT of the tokenizer service"
    )
    workers: int = flag(
        1,
        "gateway processes sharing the HTTP and gRPC ports, each with its own engine and "
        "tokenizer streams; metrics and rate limits stay the whole server's",
    )
    # Set by the parent of --workers for each worker (gateway.front.workers.WorkerSetup).
    worker_index: int | None = flag(None, hidden=True)
    listen_fd: int | None = flag(None, hidden=True)
    shared_state: str | None = flag(None, hidden=True)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
