"""The generic tool format, for chat templates that know no tools (SmolLM2's among them): the
tool definitions and how to call them go in a system message, and the conversation's earlier
calls and tool answers are written as ordinary assistant and user turns. Calls are written as
the hermes format writes them (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), so
the hermes parser reads them and the hermes grammar keeps them valid.

Text only: never talks to a service.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

from gateway.messages import ChatTurn
from gateway.openai import protocol as api
from gateway.openai.tools.grammar import parameters_schema

PARSER = "hermes"

_INSTRUCTIONS = """You can call functions (tools) to answer. Their signatures, one JSON object each:
<tools>
{signatures}
</tools>
To call one, answer with a JSON object holding its name and its arguments inside <tool_call> \
tags, one block per call, and nothing else:
<tool_call>
{{"name": "the function's name", "arguments": {{"argument": "value"}}}}
</tool_call>
{when}"""

_WHEN = {
    "auto": "Call a function when it helps; otherwise answer in plain text.",
    "required": "You must call one or more of these functions now.",
    "named": "You must call the function {name} now.",
}


def tools_prompt(tools: Sequence[api.ToolDefinition], choice: str, named: str = "") -> str:
    """The system text that describes the tools; `choice` is auto, required or named."""
    signatures = "\n".join(
        json.dumps(
            {
                "name": tool.function.name,
                "description": tool.function.description or "",
                "parameters": parameters_schema(tool),
            },
            ensure_ascii=False,
        )
        for tool in tools
    )
    return _INSTRUCTIONS.format(signatures=signatures, when=_WHEN[choice].format(name=named))


def call_text(name: str, arguments: str) -> str:
    """One call as the generic format writes it (arguments as the JSON text they are)."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def conversation(messages: Sequence[api.ChatMessage], system_text: str | None) -> list[ChatTurn]:
    """The conversation for a template that knows no tools: `system_text` (when set) leads the
    first system message, calls become assistant text and tool answers user turns."""
    out = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        content = message.text
        if message.tool_calls:
            calls = "\n".join(
                call_text(c.function.name, c.function.arguments) for c in message.tool_calls
            )
            content = f"{content}\n{calls}" if content else calls
        if role in ("tool", "function"):
            role = "user"
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append(ChatTurn(role=role, content=content, name=message.name))
    if system_text is not None:
        if out and out[0].role == "system":
            first = out[0].content
            out[0] = replace(out[0], content=f"{first}\n\n{system_text}" if first else system_text)
        else:
            out.insert(0, ChatTurn(role="system", content=system_text))
    return out
