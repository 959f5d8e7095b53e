"""The HTTP gateway's public shapes: OpenAI-compatible requests and responses (pydantic v2), the
OpenAI error body; the gateway's refusals (exceptions naming the offending field) are the
contract's, re-exported here. How a failure becomes an HTTP answer is http_errors.py's; the
OpenAPI document is openapi.py's.

Shapes and types only. Ranges of sampling parameters are the engine library's
SamplingParams.validate and context limits are generation.py's; this module never talks to a
service and never decides what a request means.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# The errors the gateway raises are the contract's (common/errors.py, one table for every
# wire); the route modules name the request errors through this module (api.InvalidParameter).
from common.errors import InvalidParameter as InvalidParameter
from common.errors import ModelNotFound as ModelNotFound
from common.errors import RateLimitExceeded as RateLimitExceeded
from common.errors import RequestTooLarge as RequestTooLarge
from common.errors import Unauthenticated as Unauthenticated
from common.errors import UnsupportedMediaType as UnsupportedMediaType
from common.sampling_params import SamplingParams


class RequestBody(BaseModel):
    # strict: "1" is not a number and 1.5 is not an integer; NaN and Infinity are refused.
    # Unknown top-level fields are refused (as OpenAI does): a misspelt or unimplemented
    # parameter must not be silently ignored. Nested objects (messages) accept extra keys, since
    # clients send back the assistant messages they received, with keys like "refusal".
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class ResponseBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=True)


# OpenAI fields this server does not implement, with the values that mean "not used": any other
# value gets a 400 instead of an answer that silently ignores it.
NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "best_of": (None, 1),
}

NonEmptyStr = Annotated[str, Field(min_length=1)]
# OpenAI's service tiers: the one a request runs in, by the one it asks for (flex is the engine's
# batch lane; the rest run as interactive requests), which its answer says.
ServiceTier = Literal["auto", "default", "flex", "priority"]
TIER_RUN: dict[str, str] = {
    "auto": "default",
    "default": "default",
    "priority": "default",
    "flex": "flex",
}
# Each word becomes up to two token sequences (as written, and after a space).
MAX_BAD_WORDS = SamplingParams.MAX_BAD_WORDS // 2
TokenIds = list[int]
# Bounds of the protobuf fields these travel in.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


RequestT = TypeVar("RequestT", bound=RequestBody)


def parse_request(model: type[RequestT], body: bytes) -> RequestT:
    """Validate a JSON body; raise InvalidParameter naming the first offending field."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidParameter(
            f"the body is not valid UTF-8: byte {exc.start} (0x{body[exc.start]:02x}) {exc.reason}"
        ) from None
    try:
        request = model.model_validate_json(text)
    except ValidationError as exc:
        raise _invalid(model, exc) from None
    extra = request.model_extra or {}
    for name, value in extra.items():
        if name in NOT_SUPPORTED and value not in NOT_SUPPORTED[name]:
            raise InvalidParameter(f"{name} is not supported by this server", name)
    unknown = [name for name in extra if name not in NOT_SUPPORTED]
    if unknown:
        raise InvalidParameter(
            f"unrecognized request argument{'s' if len(unknown) > 1 else ''} "
            f"supplied: {', '.join(unknown)}",
            unknown[0],
        )
    return request


def _invalid(model: type[RequestBody], exc: ValidationError) -> InvalidParameter:
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return InvalidParameter(f"the body is not valid JSON: {error['msg'].split(': ', 1)[-1]}")
    # A union's alternatives show up in the location as type tags ("str", "list[int]"): drop
    # them, and say what the field accepts instead of what its first alternative wanted.
    parts = [
        p
        for p in error["loc"]
        if isinstance(p, int) or not (p in ("str", "int", "float", "bool") or "[" in p)
    ]
    if not parts:
        return InvalidParameter(f"the body must be a JSON object: {error['msg']}")
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    field = model.model_fields.get(str(parts[0]))
    message = error["msg"]
    if len(parts) < len(error["loc"]) and field is not None and field.description:
        message = f"expected {field.description[0].lower()}{field.description[1:]}"
    return InvalidParameter(f"{where}: {message}", str(parts[0]))


# -- requests -----------------------------------------------------------------------------------


class StreamOptions(RequestBody):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far too (the final usage chunk comes as well).
    continuous_usage_stats: bool = False


class JsonSchemaSpec(RequestBody):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(RequestBody):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar (Lark
    or GBNF) and json_object."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(RequestBody):
    """Sampling fields shared by chat and text completions (unset: the engine's defaults)."""

    model: str | None = Field(None, description="Must name the served model when set.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(
        None, description="With n > 1, choice i uses seed + i.", ge=INT64_MIN, le=INT64_MAX
    )
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's: every token one of these ids.
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    # vLLM's: words the output never contains (each as written and after a space).
    bad_words: list[NonEmptyStr] | None = Field(None, max_length=MAX_BAD_WORDS)
    n: int = Field(1, ge=1, le=64)
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias, in [-100, 100]."
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX)
    # OpenAI's: flex runs in the engine's batch lane; the others run as interactive requests.
    service_tier: ServiceTier | None = None
    # vLLM's: logprobs name each token "token_id:N" instead of by its text.
    return_tokens_as_token_ids: bool = False
    # vLLM's: keep the prompt's last N tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    # Structured output (gateway/openai/structured.py): at most one of these.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


class ContentPart(RequestBody):
    type: Literal["text"]
    text: str


ReasoningEffort = Literal["low", "medium", "high"]

# The roles OpenAI accepts ("function" is the legacy form of "tool").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class FunctionCall(RequestBody):
    name: str
    arguments: str = Field(description="The call's arguments as JSON text.")


class ToolCall(RequestBody):
    """A call an assistant message made, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    role: NonEmptyStr
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant's calls, and a tool message's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown role {role!r}: a role is one of {', '.join(CHAT_ROLES)}")
        return role

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments (an object)."
    )
    strict: bool | None = None


class ToolDefinition(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class CacheOptions(RequestBody):
    """Folio's extension: keep the prompt's prefix in the engine's KV cache (docs/kv_tiers.md)."""

    # A misspelt key would silently drop the pin: refused, unlike other nested objects' extras.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    pin_prefix: bool = False
    # Anthropic's cache_control TTLs are 5 minutes (the default) and an hour (the engine's most).
    ttl_seconds: float = Field(300.0, gt=0, le=3600)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Overrides max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's: the final message is left open and the answer continues it (an assistant reply
    # the caller started); needs add_generation_prompt false.
    continue_final_message: bool = False
    # vLLM's: a final assistant message leads the answer's content.
    echo: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto, required, or a named function."
    )
    parallel_tool_calls: bool = True
    # Extra variables for the chat template (e.g. {"enable_thinking": false}); they never
    # replace the ones the server sets (messages, tools, add_generation_prompt, special tokens).
    chat_template_kwargs: dict[str, Any] | None = None
    # How hard a reasoning model thinks: the template's variable reasoning_effort (gpt-oss's
    # template writes it into the system message), unless chat_template_kwargs sets it.
    reasoning_effort: ReasoningEffort | None = None
    cache: CacheOptions | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="A string, a list of strings, a list of token ids or a list of such lists."
    )
    # 0 only with echo: score the prompt (its logprobs) without generating, as vLLM allows.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    # Prepend the prompt to the text, and with logprobs its tokens to the logprobs (the first
    # has logprob null).
    echo: bool | None = False


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize body: either `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# -- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(ResponseBody):
    cached_tokens: int = 0


class CompletionTokensDetails(ResponseBody):
    # Speculative decoding's drafts (OpenAI's names, from its Predicted Outputs).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Only when the engine drafted tokens for the request (--speculative-config).
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(ResponseBody):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(ResponseBody):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(ResponseBody):
    name: str
    arguments: str


class ResponseToolCall(ResponseBody):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


def is_unset(value: object) -> bool:
    return value is None


class AssistantMessage(ResponseBody):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # With a reasoning parser: the model's thinking, apart from its answer (vLLM's field).
    reasoning_content: str | None = Field(default=None, exclude_if=is_unset)
    tool_calls: list[ResponseToolCall] | None = Field(default=None, exclude_if=is_unset)


class ChatChoice(ResponseBody):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(ResponseBody):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    service_tier: str | None = Field(default=None, exclude_if=is_unset)


class DeltaFunctionCall(ResponseBody):
    name: str | None = Field(default=None, exclude_if=is_unset)
    arguments: str = ""


class DeltaToolCall(ResponseBody):
    """A piece of a streamed call: the first carries its id and name, the next ones pieces of
    its arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=is_unset)
    type: Literal["function"] | None = Field(default=None, exclude_if=is_unset)
    function: DeltaFunctionCall


class DeltaMessage(ResponseBody):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=is_unset)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=is_unset)


class ChatChunkChoice(ResponseBody):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseBody):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    service_tier: str | None = Field(default=None, exclude_if=is_unset)


class CompletionLogprobs(ResponseBody):
    tokens: list[str] = []
    # null (in both) for an echoed prompt's first token: nothing precedes it.
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(ResponseBody):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(ResponseBody):
    """A text completion; streamed as events of the same shape (usage only on the last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    service_tier: str | None = Field(default=None, exclude_if=is_unset)


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "folio"
    root: str
    max_model_len: int
    # A LoRA adapter's base model (vLLM's shape); None for the base model itself.
    parent: str | None = None


class LoadLoraAdapterRequest(RequestBody):
    """vLLM's /v1/load_lora_adapter body: lora_path inside the engine's --lora-root."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)


class LoraAdapterStatus(ResponseBody):
    object: Literal["lora_adapter"] = "lora_adapter"
    lora_name: str
    status: Literal["loaded", "unloaded"]


class ModelList(ResponseBody):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseBody):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseBody):
    prompt: str


class HealthResponse(ResponseBody):
    status: Literal["ok", "unavailable"]
    detail: str | None = None


class ErrorInfo(ResponseBody):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseBody):
    error: ErrorInfo
