"""What the gateway and its services say to each other, as plain data: the engine's model, load,
KV events and step outputs; the tokenizer's conversations, token ids and texts; the calls of
the gateway's own gRPC text API.

gateway/wire.py turns these into protobuf messages and back; everything else in the gateway
reads and writes these and never a protobuf message. Data only: no behaviour beyond its shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from common.finish_reason import FinishReason
from common.generation_config import SamplingDefaults
from common.sampling_params import SamplingParams

# -- the engine ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineModel:
    """The engine's GetModelInfo answer, as far as the gateway uses it."""

    model: str
    model_path: str
    vocab_size: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int = 0
    generate_socket_port: int = 0  # 0: the engine offers no Generate socket


@dataclass
class EngineStats:
    """An engine's GetStats answer, or the sum over the replicas."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # share of KV cache blocks in use, 0 to 1
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    step_seconds: dict[str, float] = field(default_factory=dict)  # by step phase
    block_size: int = 0
    kv_cache_dtype: str = ""
    # What a new request would wait for there (one replica's answer; not summed).
    queued_prefill_tokens: int = 0
    prefill_token_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    # Speculative decoding's counters (summed over the replicas).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # KV cache tiers, per tier ("host", "disk"): prompt tokens served (summed over the replicas)
    # and the share of capacity in use (their mean).
    kv_tier_hits: dict[str, int] = field(default_factory=dict)
    kv_tier_usage: dict[str, float] = field(default_factory=dict)
    # Prompt blocks pinned now (summed over the replicas).
    kv_pinned_blocks: int = 0
    # LoRA adapters: the running and the waiting requests' and the resident ones (the union over
    # the replicas), the slots and requests per adapter (summed).
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    resident_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
    lora_requests: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class KvEvent:
    kind: Literal["block_stored", "block_removed", "all_blocks_cleared"]
    block_hashes: tuple[bytes, ...] = ()
    medium: str = "GPU"  # "GPU": the engine's KV pool; "CPU": its host tier


@dataclass(frozen=True)
class KvEventBatch:
    """The KV events of one engine step, or a snapshot standing for every batch to its number."""

    sequence_number: int
    epoch: str
    events: tuple[KvEvent, ...]


@dataclass(frozen=True, slots=True)
class Logprob:
    """A token's logprob as the engine sends it, with its alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestError:
    """An engine request's own error: a gRPC status code, its message, the field it names and,
    when the engine refused it for now, the seconds until it could be admitted."""

    code: int
    message: str
    param: str | None = None
    retry_after: int | None = None


# Not frozen: a frozen dataclass sets each field through object.__setattr__, and these are made
# for every sequence of every engine step.
@dataclass(slots=True)
class StepOutput:
    """One sample's output of one engine step."""

    request_id: str
    index: int = 0  # the sample's index in its request
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Logprob, ...] = ()
    prompt_logprobs: tuple[Logprob, ...] = ()  # with a sample's first output, when asked for
    finished: bool = False
    finish_reason: FinishReason | None = None  # set when finished
    cached_tokens: int = 0
    # Speculative decoding: tokens drafted for the sample, and how many were accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    queue_seconds: float = 0.0
    error: RequestError | None = None
    # An embedding request's one output: its pooled vector.
    embedding: list[float] | None = None


# -- the tokenizer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant turn made, as the chat template writes it."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ChatTurn:
    """One message of a conversation, as the chat template reads it."""

    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the chat template shows it to the model."""

    name: str
    parameters: str  # JSON Schema text
    description: str | None = None


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation for the chat template to render, and how the prompt ends: with the
    assistant's header (add_generation_prompt), with nothing, or inside the final message
    (continue_final_message); `template_kwargs` are the template's extra variables."""

    messages: Sequence[ChatTurn]
    tools: Sequence[ToolSpec] = ()
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ChatFormats:
    """What the chat template teaches the model, named as vLLM names its parsers ("" for
    none): its tool-call format and how it marks reasoning."""

    tool_call: str
    reasoning: str


@dataclass(frozen=True)
class TokenizerInfo:
    """What the tokenizer service says of the model once: its chat template's formats and the
    sampling defaults it recommends (--generation-config)."""

    formats: ChatFormats
    sampling: SamplingDefaults


@dataclass(frozen=True)
class Tokenized:
    token_ids: list[int]
    prompt: str  # the text the ids stand for (a chat's rendered template)
    token_strs: list[str]  # each token's text, when asked for


# -- the gateway's own gRPC text API ------------------------------------------------------------


@dataclass(frozen=True)
class AskedLevel:
    """What a call asks of the engine's scheduler, before its API key's settings fill the rest:
    deadlines in milliseconds (None: the key's default), the tenant it names (None: none) and
    whether it runs in the batch lane."""

    ttft_ms: float | None = None
    total_ms: float | None = None
    tenant: str | None = None
    batch: bool = False


@dataclass(frozen=True)
class TextCall:
    """A call of folio.v1.GatewayService: Generate (a prompt) or Chat (messages)."""

    model: str
    params: SamplingParams
    stop: list[str]
    include_stop_str_in_output: bool
    priority: int
    prompt: str = ""
    messages: tuple[ChatTurn, ...] = ()
    asked: AskedLevel = AskedLevel()
