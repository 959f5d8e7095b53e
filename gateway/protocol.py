"""The HTTP gateway's public shapes: OpenAI-compatible requests and responses (pydantic v2), the
OpenAI error body, and the OpenAPI document built from them.

Shapes and types only. Ranges of sampling parameters are the engine library's
SamplingParams.validate and context limits are generation.py's; this module never talks to a
service and never decides what a request means.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

# The errors the gateway raises are the contract's (common/errors.py, one table for every
# wire); the route modules name the request errors through this module (api.InvalidParameter).
from common.errors import InvalidParameter as InvalidParameter
from common.errors import RateLimitExceeded, Unauthenticated, mapping_for
from common.errors import RequestTooLarge as RequestTooLarge
from common.errors import UnsupportedMediaType as UnsupportedMediaType


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
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "best_of": (None, 1),
}

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = list[int]
# Bounds of the protobuf fields these travel in.
INT32 = dict(ge=-(2**31), le=2**31 - 1)
INT64 = dict(ge=-(2**63), le=2**63 - 1)


def parse_request(model: type[RequestBody], body: bytes) -> Any:
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
    top_k: int | None = Field(None, **INT32)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, description="With n > 1, choice i uses seed + i.", **INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=64)
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias.")
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, **INT32)
    # Structured output (gateway/structured.py): at most one of these.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


class ContentPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: NonEmptyStr
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Overrides max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


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
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# -- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(ResponseBody):
    cached_tokens: int = 0


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(ResponseBody):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(ResponseBody):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(ResponseBody):
    role: Literal["assistant"] = "assistant"
    content: str


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


class DeltaMessage(ResponseBody):
    role: Literal["assistant"] | None = None
    content: str | None = None


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


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "folio"
    root: str
    max_model_len: int


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


def error_body(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The HTTP status and OpenAI error body for an exception (anything unknown is a 500)."""
    row = mapping_for(exc)
    message = str(exc) if row.http_status != 500 else f"internal error: {exc}"
    return row.http_status, ErrorResponse(
        error=ErrorInfo(
            message=message,
            type=row.openai_type,
            param=getattr(exc, "param", None),
            code=row.openai_code,
        )
    )


def error_headers(exc: BaseException) -> dict[str, str]:
    """The HTTP headers an error answer carries besides its body."""
    if isinstance(exc, Unauthenticated):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, RateLimitExceeded) and exc.retry_after is not None:
        return {"Retry-After": str(exc.retry_after)}
    return {}


# -- OpenAPI ------------------------------------------------------------------------------------


# The gateway's error statuses as the OpenAPI document describes them; each answer carries
# the OpenAI error body.
ERROR_STATUSES: dict[int, str] = {
    400: "Invalid request; `param` names the offending field",
    401: "No valid API key came with the request",
    404: "The model does not exist",
    413: "The body is over the gateway's size limit",
    415: "The body is not sent as application/json",
    429: "The engine's queue is full or the caller is over a rate limit; retry later",
    500: "Internal error",
    503: "The engine or the tokenizer is unavailable, or the gateway is draining",
    504: "The request ran out of time",
}


def openapi_document(endpoints: list[Any], title: str, version: str) -> dict:
    """OpenAPI 3.1 for `endpoints` (objects with path, method, summary, request, response,
    stream, media_type, answers and errors attributes); schemas come from the models above.
    Every status an operation can answer is listed (no `default`), so a client and a fuzzer
    can tell an undocumented one."""
    models = {m for e in endpoints for m in (e.request, e.response, e.stream) if m is not None}
    models.add(ErrorResponse)
    keyed = [
        (m, "validation" if issubclass(m, RequestBody) else "serialization")
        for m in sorted(models, key=lambda m: m.__name__)
    ]
    refs, defs = models_json_schema(keyed, ref_template="#/components/schemas/{model}")
    for e in endpoints:  # parse_request refuses unknown top-level fields
        if e.request is not None:
            defs["$defs"][e.request.__name__]["additionalProperties"] = False

    def ref(model: type[BaseModel]) -> dict:
        return refs[(model, "validation" if issubclass(model, RequestBody) else "serialization")]

    def error(status: int) -> dict:
        return {
            "description": ERROR_STATUSES[status],
            "content": {"application/json": {"schema": ref(ErrorResponse)}},
        }

    paths: dict[str, dict] = {}
    for e in endpoints:
        content: dict[str, Any] = {}
        if e.response is not None:
            content[e.media_type] = {"schema": ref(e.response)}
        if e.stream is not None:
            # Before OpenAPI 3.2, the schema of an event stream describes one event.
            content["text/event-stream"] = {
                "schema": {
                    "description": "With stream=true, one event per delta: its data is a chunk, or "
                    "an error body when the stream fails midway; the last event's "
                    "data is [DONE].",
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "data": {
                            "anyOf": [
                                {"const": "[DONE]"},
                                {
                                    "type": "string",
                                    "contentMediaType": "application/json",
                                    "contentSchema": {"anyOf": [ref(e.stream), ref(ErrorResponse)]},
                                },
                            ]
                        }
                    },
                }
            }
        responses = {
            str(status): {"description": HTTPStatus(status).phrase, "content": content}
            for status in e.answers
        }
        responses.update({str(status): error(status) for status in sorted(e.errors)})
        operation: dict[str, Any] = {"summary": e.summary, "responses": responses}
        if e.request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref(e.request)}},
            }
        paths.setdefault(e.path, {})[e.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }
