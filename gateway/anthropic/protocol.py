"""The Messages API's public shapes (pydantic v2), as the anthropic client sends and reads them:
the request and its content blocks, the Message with its usage, the stream's events and the
error body.

Shapes only: what a request means is translate.py's, the order of events is events.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.openai import protocol as api


class CacheControl(api.RequestBody):
    """A cache breakpoint: here Folio pins the prompt's prefix for the TTL (docs/kv_tiers.md)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


# The seconds each CacheControl.ttl stands for.
CACHE_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class TextBlock(api.RequestBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(api.RequestBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(api.RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(api.RequestBody):
    """An assistant's earlier thinking, sent back as it came (not fed to the model again)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(api.RequestBody):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class InputMessage(api.RequestBody):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(api.RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(api.RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="The tool to call, with type tool.")
    disable_parallel_tool_use: bool = False


class ThinkingConfig(api.RequestBody):
    """Extended thinking: enabled returns the model's reasoning as thinking blocks (with a
    reasoning parser); disabled asks the chat template not to think (enable_thinking false).
    budget_tokens is required with enabled, as Anthropic requires it, but not enforced: the
    reasoning ends where the model ends it, within max_tokens."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024)


class CountTokensRequest(api.RequestBody):
    model: str | None = Field(None, description="Must name the served model when set.")
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=api.INT32_MIN, le=api.INT32_MAX)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # Anthropic's tiers: both run as Folio's one interactive tier (standard capacity).
    service_tier: Literal["auto", "standard_only"] | None = None


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextContent(api.ResponseBody):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(api.ResponseBody):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(api.ResponseBody):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing is signed here


OutputBlock = ThinkingContent | TextContent | ToolUseContent


class MessageUsage(api.ResponseBody):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


class Message(api.ResponseBody):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(api.ResponseBody):
    input_tokens: int


class MessagesError(api.ResponseBody):
    type: str
    message: str


class MessagesErrorResponse(api.ResponseBody):
    type: Literal["error"] = "error"
    error: MessagesError


class EventDelta(api.ResponseBody):
    """A content_block_delta's delta (text_delta, thinking_delta, input_json_delta), or
    message_delta's."""

    type: str | None = Field(default=None, exclude_if=api.is_unset)
    text: str | None = Field(default=None, exclude_if=api.is_unset)
    thinking: str | None = Field(default=None, exclude_if=api.is_unset)
    partial_json: str | None = Field(default=None, exclude_if=api.is_unset)
    stop_reason: StopReason | None = Field(default=None, exclude_if=api.is_unset)
    stop_sequence: str | None = Field(default=None, exclude_if=api.is_unset)


class DeltaUsage(api.ResponseBody):
    output_tokens: int


class StreamEvent(api.ResponseBody):
    """One event of a streamed message, named by its type: message_start, ping,
    content_block_start / _delta / _stop, message_delta, message_stop, or error."""

    type: str
    message: Message | None = Field(default=None, exclude_if=api.is_unset)
    index: int | None = Field(default=None, exclude_if=api.is_unset)
    content_block: OutputBlock | None = Field(default=None, exclude_if=api.is_unset)
    delta: EventDelta | None = Field(default=None, exclude_if=api.is_unset)
    usage: DeltaUsage | None = Field(default=None, exclude_if=api.is_unset)
    error: MessagesError | None = Field(default=None, exclude_if=api.is_unset)


# -- Models (/v1/models, as the anthropic client asks it) ---------------------------------------


class ModelInfo(api.ResponseBody):
    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str  # RFC 3339
    # The context: what a prompt may hold, and what prompt and answer together may.
    max_input_tokens: int
    max_tokens: int


class ModelList(api.ResponseBody):
    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


# -- Message Batches (/v1/messages/batches) -----------------------------------------------------

# Anthropic's limit on a batch's requests.
MAX_BATCH_REQUESTS = 100_000
DEFAULT_BATCH_LIST = 20
MAX_BATCH_LIST = 1000


class BatchRequest(api.RequestBody):
    """One request of a batch: its id within the batch and a Messages request's body (checked
    when it runs: a bad one is that request's `errored` result)."""

    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]


class MessageBatchCreateRequest(api.RequestBody):
    requests: list[BatchRequest] = Field(min_length=1, max_length=MAX_BATCH_REQUESTS)


class MessageBatchListQuery(api.RequestBody):
    """GET /v1/messages/batches' query parameters: newest first, the page older than after_id
    or the one just newer than before_id."""

    limit: int = Field(DEFAULT_BATCH_LIST, ge=1, le=MAX_BATCH_LIST)
    after_id: str | None = None
    before_id: str | None = None


class MessageBatchRequestCounts(api.ResponseBody):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(api.ResponseBody):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchRequestCounts
    # RFC 3339 times, as Anthropic writes them.
    created_at: str
    expires_at: str
    ended_at: str | None = None
    cancel_initiated_at: str | None = None
    archived_at: str | None = None
    # Where the results are, once the batch has ended.
    results_url: str | None = None


class MessageBatchList(api.ResponseBody):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class DeletedMessageBatch(api.ResponseBody):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"


class BatchResult(api.ResponseBody):
    """One request's outcome: its Message (succeeded), its error (errored), or neither
    (canceled, expired)."""

    type: Literal["succeeded", "errored", "canceled", "expired"]
    message: dict[str, Any] | None = Field(default=None, exclude_if=api.is_unset)
    error: MessagesErrorResponse | None = Field(default=None, exclude_if=api.is_unset)


class BatchResultLine(api.ResponseBody):
    """A line of the results file."""

    custom_id: str
    result: BatchResult
