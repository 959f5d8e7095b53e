"""The grammars that keep tool calls valid: for a required or named tool_choice, output that is
only calls of the given tools, each call's arguments satisfying its tool's parameter schema;
for the generic format's auto, either a plain answer or such calls. Harmony's (the `openai`
family, gpt-oss) lets the model think in free analysis messages first, then holds it to
commentary messages to `functions.NAME`; the harmony grammar's parts are here for the
reasoning grammar too (its final channel held to a constraint), and the free text up to a
marker both reasoning formats use.

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
from gateway.openai.tools import harmony

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
HARMONY = "openai"  # the family whose calls are harmony messages, not call objects


@dataclass(frozen=True)
class MarkerTokens:
    """The token id of each marker the tokenizer holds as one token (the others are absent)."""

    ids: dict[str, int]

    def lark(self, marker: str) -> str:
        """`marker` in a Lark rule: its token or its text."""
        literal = json.dumps(marker)
        token = self.ids.get(marker)
        return literal if token is None else f"(<[{token}]> | {literal})"


NO_MARKERS = MarkerTokens({})


def lark_regex(regex: str) -> str:
    """`regex` inside a Lark /.../ literal: each unescaped slash escaped."""
    out = []
    escaped = False
    for char in regex:
        if char == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(char)
        escaped = char == "\\" and not escaped
    return "".join(out)


def free_text(rule: str, end: str, stops: Sequence[str], markers: MarkerTokens) -> list[str]:
    """Lark lines for `rule`: free text ended by `end`, never holding any of `stops` (which a
    parser would read as the text's end). Text up to and including the first `end`: once
    that is written the lexeme cannot grow; or text without it, ended by `end`'s own token."""
    name = rule.upper()
    ending = lark_regex(re.escape(end))
    stop = "(" + "|".join(lark_regex(re.escape(s)) for s in stops) + ")"
    token = markers.ids.get(end)
    return [
        f"{rule}: {name}" + ("" if token is None else f" | {name}_FREE <[{token}]>"),
        f"{name}: /(?s:.*){ending}/ & ~/(?s:.*){stop}(?s:.+)/",
        f"{name}_FREE: /(?s:.*)/ & ~/(?s:.*){stop}(?s:.*)/",
    ]


def harmony_lines(markers: MarkerTokens, then: str) -> list[str]:
    """The start of a harmony grammar: any number of free analysis messages, then the rule
    `then` (the answer's messages). Each message may open with `<|start|>assistant` (the
    generation prompt writes the first one's)."""
    m = markers.lark
    return [
        f"start: analysis* {then}",
        f'head: ({m(harmony.START)} "assistant")? {m(harmony.CHANNEL)}',
        f'analysis: head "{harmony.ANALYSIS}" {m(harmony.MESSAGE)} reasoning',
        *free_text("reasoning", harmony.END, harmony.ENDS, markers),
    ]


def final_lines(markers: MarkerTokens, answer: str) -> list[str]:
    """A harmony grammar whose answer is the final channel's body, `answer` (a Lark rule's
    right-hand side), optionally closed by `<|return|>`."""
    m = markers.lark
    return [
        *harmony_lines(markers, "final"),
        f'final: head "final" {m(harmony.MESSAGE)} answer {m(harmony.RETURN)}?',
        f"answer: {answer}",
    ]


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
    covers_reasoning: bool = False  # the grammar lets the model think first (harmony)

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
    markers: MarkerTokens = NO_MARKERS,
) -> ToolGrammar:
    """Calls of tools[i] for i in `indices`, in `family`'s syntax: one, or with `parallel` one
    or more; with `allow_answer` (hermes only) a plain answer instead is allowed too.
    `markers`: harmony's marker tokens (the `openai` family)."""
    m = markers.lark
    syntax = SYNTAX.get(family)
    if syntax is None:  # harmony: analysis first, then calls
        lines = [
            *harmony_lines(markers, "call+" if parallel else "call"),
            f'call: head "commentary to={harmony.FUNCTIONS}" tool {m(harmony.CALL)}',
        ]
    else:
        calls = [f'"{_lark(syntax.prefix)}"'] if syntax.prefix else []
        calls.append(f'call ("{syntax.separator}" call)*' if parallel else "call")
        if syntax.suffix:
            calls.append(f'"{_lark(syntax.suffix)}"')
        lines = [
            "start: ANSWER | calls" if allow_answer else "start: calls",
            "calls: " + " ".join(calls),
            f"call: {syntax.one_call}",
        ]
        if allow_answer:
            lines.append(f"ANSWER: {_PLAIN_ANSWER}")
    lines.append("tool: " + " | ".join(f"tool_{i}" for i in indices))
    tool_lines = {}
    for i in indices:
        tool = tools[i]
        schema = json.dumps({"x-guidance": JSON_FORMAT, **parameters_schema(tool)})
        if syntax is None:  # harmony: the name in the header, the arguments the body
            head = f'{json.dumps(tool.function.name + " ")} {m(harmony.CONSTRAIN)} "json" '
            lines.append(f"tool_{i}: {head}{m(harmony.MESSAGE)} %json {schema}")
        else:
            head = f'{{"name": {json.dumps(tool.function.name)}, "{syntax.arguments_key}": '
            lines.append(f'tool_{i}: {json.dumps(head)} %json {schema} "}}"')
        tool_lines[len(lines)] = i
    source = f"tools[{indices[0]}]" if len(indices) == 1 else "tools"
    constraint = StructuredOutput(grammar="\n".join(lines) + "\n", source=source)
    return ToolGrammar(constraint, tool_lines, allow_answer, covers_reasoning=family == HARMONY)


def _lark(text: str) -> str:
    """`text` inside a Lark string literal (JSON escapes are Lark's)."""
    return json.dumps(text)[1:-1]
