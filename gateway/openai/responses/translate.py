"""A Responses request mapped onto the chat path: `input` items and `instructions` become chat
messages (function_call items an assistant's tool calls, function_call_output items tool
messages), tools and text.format their chat equivalents; and a chat answer (content and calls)
becomes the Response's output items and usage.

Translation only: never talks to a service and never touches an HTTP connection.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.openai import protocol as api
from gateway.openai.reasoning.reader import Answer
from gateway.openai.responses import protocol as rapi
from gateway.pipeline.text import Usage

ROLES = ("user", "assistant", "system", "developer")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise api.InvalidParameter(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise api.InvalidParameter(
                f"{where}.content[{j}] must be an input_text or output_text part with its text "
                f"(got type {kind!r}): this server reads text only",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise api.InvalidParameter(f"{where}.{key} must be a string", "input")
    return value


def messages(body: rapi.ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (dicts in the chat request's shape)."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        out.append({"role": "user", "content": body.input})
        return out
    if not body.input:
        raise api.InvalidParameter("input must not be empty", "input")
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise api.InvalidParameter(
                    f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "input"
                )
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            # Consecutive calls are one assistant turn, as the chat API writes them.
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # earlier thinking, sent back as it came: not fed to the model again
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(output, where),
                }
            )
        else:
            raise api.InvalidParameter(
                f"{where}.type {kind!r} is not supported: use message, function_call, "
                "function_call_output or reasoning",
                "input",
            )
    return out


def chat_request(body: rapi.ResponsesRequest) -> api.ChatCompletionRequest:
    """The chat request that answers `body`; InvalidParameter for what this server refuses."""
    if body.previous_response_id is not None:
        raise api.InvalidParameter(
            "previous_response_id is not supported: this server stores no responses; send the "
            "whole conversation in input",
            "previous_response_id",
        )
    chat: dict[str, Any] = {
        "messages": messages(body),
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    for name, value in (
        ("model", body.model),
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("seed", body.seed),
        ("user", body.user),
        ("service_tier", body.service_tier),
    ):
        if value is not None:
            chat[name] = value
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": tool.model_dump(exclude={"type"}, exclude_none=True),
            }
            for tool in body.tools
        ]
    if isinstance(body.tool_choice, rapi.FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        if text_format.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            if text_format.json_schema is None:
                raise api.InvalidParameter(
                    "text.format of type json_schema needs its schema", "text"
                )
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": text_format.name or "schema",
                    "schema": text_format.json_schema,
                },
            }
    try:
        return api.ChatCompletionRequest.model_validate(chat)
    except ValueError as exc:  # a field the chat request refuses, e.g. a message's shape
        raise api.InvalidParameter(f"input: {exc}", "input") from None


@dataclass
class ResponseHead:
    """What every Response of a request says besides its output."""

    id: str
    model: str
    created_at: int
    body: rapi.ResponsesRequest

    @classmethod
    def of(cls, body: rapi.ResponsesRequest, model: str) -> ResponseHead:
        return cls(item_id("resp"), model, int(time.time()), body)

    def response(
        self,
        status: rapi.ItemStatus,
        output: list[rapi.OutputItem],
        usage: Usage | None = None,
        finish_reason: str | None = None,
    ) -> rapi.Response:
        body = self.body
        if status == "completed" and finish_reason == "length":
            status = "incomplete"
        return rapi.Response.model_validate(
            {
                "id": self.id,
                "created_at": self.created_at,
                "status": status,
                "incomplete_details": (
                    {"reason": "max_output_tokens"} if status == "incomplete" else None
                ),
                "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens,
                "model": self.model,
                "output": output,
                "parallel_tool_calls": body.parallel_tool_calls,
                "temperature": body.temperature,
                "top_p": body.top_p,
                "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
                "tools": body.tools or [],
                "text": body.text or {"format": {"type": "text"}},
                "reasoning": body.reasoning or {},
                "metadata": body.metadata or {},
                "service_tier": api.TIER_RUN.get(body.service_tier or ""),
                "user": body.user,
                "usage": response_usage(usage) if usage is not None else None,
            }
        )


def response_usage(usage: Usage) -> rapi.ResponseUsage:
    return rapi.ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=rapi.InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=rapi.OutputTokensDetails(),
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


def output_items(whole: Answer, status: rapi.ItemStatus) -> Iterator[rapi.OutputItem]:
    """A whole answer's output items: its reasoning (if any), its text (if any) as a message,
    then its calls."""
    if whole.reasoning is not None:
        yield rapi.ReasoningItem(
            id=item_id("rs"), content=[rapi.ReasoningText(text=whole.reasoning)], status=status
        )
    answer = whole.parsed
    if answer.content or not answer.calls:
        yield rapi.OutputMessage(
            id=item_id("msg"), status=status, content=[rapi.OutputText(text=answer.content)]
        )
    for call in answer.calls:
        yield rapi.FunctionCallItem(
            id=item_id("fc"),
            call_id=call.id,
            name=call.name,
            arguments=call.arguments,
            status=status,
        )
