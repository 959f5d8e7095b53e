"""A Messages request mapped onto the chat path: `system` and the messages' blocks become chat
messages (tool_use blocks an assistant's tool calls, tool_result blocks tool messages; a final
assistant message is continued, not answered: Anthropic's prefill), tools, tool_choice,
stop_sequences and the sampling fields their chat equivalents; and a chat answer (content and
calls, the engine's finish reason, usage) becomes the Message, its stop reason and usage.
Failures become Anthropic's error body.

Translation only: never talks to a service and never touches an HTTP connection.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gateway.anthropic import protocol as aapi
from gateway.front.http_errors import error_body as openai_error_body
from gateway.openai import protocol as api
from gateway.openai.reasoning.reader import Answer
from gateway.pipeline.text import Usage

# Anthropic's error type for each HTTP status the gateway answers.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(exc: BaseException) -> tuple[int, aapi.MessagesErrorResponse]:
    """The HTTP status and Anthropic error body of a failure: the same status and message as
    the OpenAI routes answer, in Anthropic's shape."""
    status, body = openai_error_body(exc)
    kind = ERROR_TYPES.get(status, "api_error")
    return status, aapi.MessagesErrorResponse(
        error=aapi.MessagesError(type=kind, message=body.error.message)
    )


def rfc3339(seconds: int) -> str:
    """A Unix time as Anthropic writes times."""
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def model_info(card: api.ModelCard) -> aapi.ModelInfo:
    """A /v1/models entry as the anthropic client reads it (it sends anthropic-version)."""
    return aapi.ModelInfo(
        id=card.id,
        display_name=card.id,
        created_at=rfc3339(card.created),
        max_input_tokens=card.max_model_len,
        max_tokens=card.max_model_len,
    )


def _text(content: str | list[aapi.TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _refuse(block: aapi.ContentBlock, role: str, where: str) -> api.InvalidParameter:
    return api.InvalidParameter(
        f"{where}: a {role} message cannot hold a {block.type} block", "messages"
    )


def _user(message: aapi.InputMessage, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages (they answer the calls just made), then
    its text."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    texts = []
    for j, block in enumerate(message.content):
        if isinstance(block, aapi.ToolResultBlock):
            out.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)}
            )
        elif isinstance(block, aapi.TextBlock):
            texts.append(block.text)
        else:
            raise _refuse(block, "user", f"{where}.content[{j}]")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(message: aapi.InputMessage, where: str) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, calls = [], []
    for j, block in enumerate(message.content):
        if isinstance(block, aapi.ToolUseBlock):
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input)},
                }
            )
        elif isinstance(block, aapi.TextBlock):
            texts.append(block.text)
        elif not isinstance(block, (aapi.ThinkingBlock, aapi.RedactedThinkingBlock)):
            # Earlier thinking is dropped, as chat templates drop it.
            raise _refuse(block, "assistant", f"{where}.content[{j}]")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_choice(choice: aapi.ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        if choice.name is None:
            raise api.InvalidParameter(
                "tool_choice of type tool needs the tool's name", "tool_choice"
            )
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(body: aapi.CountTokensRequest) -> api.ChatCompletionRequest:
    """The chat request that answers `body` (or counts its prompt, for count_tokens);
    InvalidParameter for what this server refuses."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if message.role == "user":
            messages += _user(message, where)
        else:
            messages.append(_assistant(message, where))
    chat: dict[str, Any] = {"messages": messages}
    if body.messages and body.messages[-1].role == "assistant":
        # Anthropic's prefill: the answer continues the assistant's final message.
        chat.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(body, aapi.MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stream=body.stream)
        for name, value in (
            ("temperature", body.temperature),
            ("top_p", body.top_p),
            ("top_k", body.top_k),
            ("stop", body.stop_sequences),
        ):
            if value is not None:
                chat[name] = value
    if body.model is not None:
        chat["model"] = body.model
    if body.thinking is not None:
        _check_thinking(body.thinking)
        if body.thinking.type == "disabled":
            chat["chat_template_kwargs"] = {"enable_thinking": False}
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "parameters": tool.input_schema,
                    **({"description": tool.description} if tool.description else {}),
                },
            }
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
        chat["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    ttls = [aapi.CACHE_TTL_SECONDS[control.ttl] for control in _cache_controls(body)]
    if ttls:  # the prompt is pinned whole, for the longest TTL asked
        chat["cache"] = {"pin_prefix": True, "ttl_seconds": max(ttls)}
    try:
        return api.ChatCompletionRequest.model_validate(chat)
    except ValueError as exc:  # a field the chat request refuses
        raise api.InvalidParameter(f"messages: {exc}", "messages") from None


def _cache_controls(body: aapi.CountTokensRequest) -> list[aapi.CacheControl]:
    """Every cache breakpoint the request sets: on tools, system blocks and message blocks."""
    blocks: list[Any] = list(body.tools or [])
    if isinstance(body.system, list):
        blocks += body.system
    for message in body.messages:
        if isinstance(message.content, list):
            for block in message.content:
                blocks.append(block)
                if isinstance(block, aapi.ToolResultBlock) and isinstance(block.content, list):
                    blocks += block.content
    return [block.cache_control for block in blocks if getattr(block, "cache_control", None)]


def _check_thinking(thinking: aapi.ThinkingConfig) -> None:
    if thinking.type == "enabled" and thinking.budget_tokens is None:
        raise api.InvalidParameter("thinking of type enabled needs budget_tokens", "thinking")


def shows_thinking(body: aapi.MessagesRequest) -> bool:
    """Whether the answer's reasoning (with a reasoning parser) comes back as thinking blocks;
    otherwise it is left out."""
    return body.thinking is not None and body.thinking.type == "enabled"


def stop_reason(finish_reason: str | None, stop_matched: str | None, calls: int) -> aapi.StopReason:
    """The engine's finish reason as Anthropic says it."""
    if finish_reason == "length":
        return "max_tokens"
    if stop_matched:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use block's input object. Unconstrained (tool_choice
    auto) the model may write arguments that are no JSON object: those travel as {} rather
    than failing the whole answer."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage(input_tokens: int, usage: Usage | None) -> aapi.MessageUsage:
    if usage is None:
        return aapi.MessageUsage(input_tokens=input_tokens, output_tokens=0)
    return aapi.MessageUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=usage.cached_tokens,
    )


@dataclass
class MessageHead:
    """What every Message of a request says besides its content."""

    id: str
    model: str
    input_tokens: int  # the prompt's length, known before any output
    thinking: bool = False  # the reasoning comes back as thinking blocks

    @classmethod
    def of(cls, model: str, input_tokens: int, thinking: bool = False) -> MessageHead:
        return cls(f"msg_{uuid.uuid4().hex}", model, input_tokens, thinking)

    def message(
        self,
        content: list[aapi.OutputBlock],
        reason: aapi.StopReason | None = None,
        stop_matched: str | None = None,
        final_usage: Usage | None = None,
    ) -> aapi.Message:
        return aapi.Message(
            id=self.id,
            model=self.model,
            content=content,
            stop_reason=reason,
            stop_sequence=stop_matched if reason == "stop_sequence" else None,
            usage=usage(self.input_tokens, final_usage),
        )


def content_blocks(whole: Answer, thinking: bool) -> list[aapi.OutputBlock]:
    """A whole answer's blocks: its reasoning (if any, and `thinking`), its text (if any), then
    its calls."""
    blocks: list[aapi.OutputBlock] = []
    if thinking and whole.reasoning is not None:
        blocks.append(aapi.ThinkingContent(thinking=whole.reasoning))
    answer = whole.parsed
    if answer.content or not answer.calls:
        blocks.append(aapi.TextContent(text=answer.content))
    blocks += [
        aapi.ToolUseContent(id=call.id, name=call.name, input=tool_input(call.arguments))
        for call in answer.calls
    ]
    return blocks
