"""The grammars that keep tool calls valid: for a required or named tool_choice, output that is
only calls of the given tools, each call's arguments satisfying its tool's parameter schema;
for the generic format's auto, either a plain answer or such calls.

Written as llguidance Lark text with each tool's schema inline (`%json`), carried to the engine
as a StructuredOutput grammar labelled "tools" (or "tools[i]" for a named tool); the engine
compiles it. Its refusal of a schema points at a line of the grammar, which names the tool
(`ToolGrammar.naming_tool`). Text only: never imports llguidance or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidParameter, InvalidRequestError
from common.sampling_params import StructuredOutput
from gateway.openai import protocol as api

# Arguments written compactly, as the engine writes JSON under a schema: bounded schemas bound
# the tokens a call takes. A tool's own "x-guidance" settings win.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Free text that never opens a call: the generic format's plain answer under tool_choice auto.
_PLAIN_ANSWER = r"/(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/"
_ERROR_LINE = re.compile(r"\bat (\d+)\(")


@dataclass(frozen=True)
class CallSyntax:
    """How a family writes its calls, as Lark: the whole output (`start`, using `calls`, the
    list of calls) and one call (`call`, using `tool`, a call object)."""

    arguments_key: str
    one_call: str  # Lark: one call, using the rule `tool`
    separator: str  # between parallel calls
    prefix: str = ""  # before the first call
    suffix: str = ""  # after the last


SYNTAX = {
    "hermes": CallSyntax("arguments", r'"<tool_call>\n" tool "\n</tool_call>"', r"\n"),
    "llama3_json": CallSyntax("parameters", "tool", "; "),
    "mistral": CallSyntax("arguments", "tool", ", ", "[TOOL_CALLS][", "]"),
}


def parameters_schema(tool: api.ToolDefinition) -> dict[str, Any]:
    """A tool's parameter schema; none given means no arguments."""
    schema = tool.function.parameters
    if schema is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return schema


@dataclass(frozen=True)
class ToolGrammar:
    constraint: StructuredOutput
    tool_lines: dict[int, int]  # grammar line (1-based) -> index of the tool defined there
    allows_answer: bool  # a plain answer instead of calls (tool_choice auto)

    def naming_tool(self, exc: InvalidRequestError) -> InvalidRequestError:
        """The engine's refusal of this grammar, as a 400 naming the tool whose schema it
        refused (`tools[i]`); other errors unchanged."""
        if exc.param != self.constraint.source:
            return exc
        found = _ERROR_LINE.search(str(exc))
        index = self.tool_lines.get(int(found.group(1))) if found else None
        if found is None or index is None:
            return exc
        # llguidance's first line says what is wrong; the grammar it quotes after is ours.
        problem = str(exc)[found.end() :].split("): ", 1)[-1].split("\n", 1)[0]
        return InvalidParameter(
            f"tools[{index}] has a parameters schema that does not compile: {problem}",
            f"tools[{index}]",
        )


def tool_grammar(
    family: str,
    tools: Sequence[api.ToolDefinition],
    indices: Sequence[int],
    parallel: bool,
    allow_answer: bool,
) -> ToolGrammar:
    """Calls of tools[i] for i in `indices`, in `family`'s syntax: one, or with `parallel` one
    or more; with `allow_answer` (hermes only) a plain answer instead is allowed too."""
    syntax = SYNTAX[family]
    calls = [f'"{_lark(syntax.prefix)}"'] if syntax.prefix else []
    calls.append(f'call ("{syntax.separator}" call)*' if parallel else "call")
    if syntax.suffix:
        calls.append(f'"{_lark(syntax.suffix)}"')
    lines = [
        "start: ANSWER | calls" if allow_answer else "start: calls",
        "calls: " + " ".join(calls),
        f"call: {syntax.one_call}",
        "tool: " + " | ".join(f"tool_{i}" for i in indices),
    ]
    if allow_answer:
        lines.append(f"ANSWER: {_PLAIN_ANSWER}")
    tool_lines = {}
    for i in indices:
        tool = tools[i]
        head = f'{{"name": {json.dumps(tool.function.name)}, "{syntax.arguments_key}": '
        schema = {"x-guidance": JSON_FORMAT, **parameters_schema(tool)}
        lines.append(f'tool_{i}: {json.dumps(head)} %json {json.dumps(schema)} "}}"')
        tool_lines[len(lines)] = i
    source = f"tools[{indices[0]}]" if len(indices) == 1 else "tools"
    constraint = StructuredOutput(grammar="\n".join(lines) + "\n", source=source)
    return ToolGrammar(constraint, tool_lines, allow_answer)


def _lark(text: str) -> str:
    """`text` inside a Lark string literal (JSON escapes are Lark's)."""
    return json.dumps(text)[1:-1]
