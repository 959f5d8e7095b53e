"""The Responses API's public shapes (pydantic v2), as the openai client sends and reads them:
the request, the Response object with its output items and usage, and the stream's events.

Shapes only: what a request means is translate.py's, the order of events is events.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from gateway.openai import protocol as api


class FunctionTool(api.RequestBody):
    """A function the model may call (the Responses API writes it flat)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(api.RequestBody):
    type: Literal["function"]
    name: str


class TextFormat(api.RequestBody):
    # Written back in the Response as it came (`schema`), unset fields left out.
    model_config = ConfigDict(serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, exclude_if=api.is_unset)
    description: str | None = Field(default=None, exclude_if=api.is_unset)
    json_schema: dict[str, Any] | None = Field(
        default=None, alias="schema", exclude_if=api.is_unset
    )
    strict: bool | None = Field(default=None, exclude_if=api.is_unset)


class TextConfig(api.RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(api.RequestBody):
    """OpenAI's `reasoning`: the effort goes to the chat template (as chat's reasoning_effort);
    the reasoning comes back whole (a reasoning item's text), so a summary is the server's
    choice (`auto`) or none."""

    effort: api.ReasoningEffort | None = None
    summary: Literal["auto"] | None = None


class ResponsesRequest(api.RequestBody):
    model: str | None = Field(None, description="Must name the served model when set.")
    input: str | list[dict[str, Any]] = Field(
        description="A string, or a list of message, function_call and function_call_output items."
    )
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None, description="none, auto, required, or a named function."
    )
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # A prompt over the context is a 400, never cut ("auto", dropping items, is not served).
    truncation: Literal["disabled"] = "disabled"
    stream: bool = False
    # Nothing is stored: store is accepted and the response says store: false.
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # flex: the engine's batch lane, as in chat completions.
    service_tier: api.ServiceTier | None = None
    # Not OpenAI's: reproducible sampling, as in chat completions.
    seed: int | None = Field(None, ge=api.INT64_MIN, le=api.INT64_MAX)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(api.ResponseBody):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(api.ResponseBody):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(api.ResponseBody):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(api.ResponseBody):
    """The model's thinking, with a reasoning parser: its text as one reasoning_text part (no
    summary is written)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(api.ResponseBody):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(api.ResponseBody):
    cached_tokens: int = 0


class OutputTokensDetails(api.ResponseBody):
    reasoning_tokens: int = 0


class ResponseUsage(api.ResponseBody):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(api.ResponseBody):
    reason: Literal["max_output_tokens", "content_filter"]


class Response(api.ResponseBody):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ItemStatus
    error: api.ErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[FunctionTool]
    text: TextConfig
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    truncation: Literal["disabled"] = "disabled"
    store: Literal[False] = False
    metadata: dict[str, str] = Field(default_factory=dict)
    service_tier: str | None = None
    previous_response_id: None = None
    user: str | None = None
    usage: ResponseUsage | None = None


class ResponseEvent(api.ResponseBody):
    """One event of a streamed response: its type, its place in the stream and its fields
    (response, item, output_index, delta, ...), as the Responses API names them."""

    type: str
    sequence_number: int
    response: Response | None = Field(default=None, exclude_if=api.is_unset)
    output_index: int | None = Field(default=None, exclude_if=api.is_unset)
    item_id: str | None = Field(default=None, exclude_if=api.is_unset)
    item: OutputItem | None = Field(default=None, exclude_if=api.is_unset)
    content_index: int | None = Field(default=None, exclude_if=api.is_unset)
    part: OutputText | ReasoningText | None = Field(default=None, exclude_if=api.is_unset)
    delta: str | None = Field(default=None, exclude_if=api.is_unset)
    text: str | None = Field(default=None, exclude_if=api.is_unset)
    arguments: str | None = Field(default=None, exclude_if=api.is_unset)
    name: str | None = Field(default=None, exclude_if=api.is_unset)
    logprobs: list[Any] | None = Field(default=None, exclude_if=api.is_unset)
    # type "error"
    code: str | None = Field(default=None, exclude_if=api.is_unset)
    message: str | None = Field(default=None, exclude_if=api.is_unset)
    param: str | None = Field(default=None, exclude_if=api.is_unset)
