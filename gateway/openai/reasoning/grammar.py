"""Structured output after the reasoning: a request's constraint (response_format, a regex, a
choice, a Lark grammar, or the tools' grammar) rewritten as one llguidance Lark grammar that
lets the model think freely up to `</think>` and then holds the answer to the constraint, so
the engine compiles and enforces it like any other grammar (no engine change).

    start: open? think answer              (the answer begins in reasoning)
    start: open think answer | answer      (qwen3 outside a block: thinking is optional)
    open: <[id]> | "<think>"
    think: REASONING <[id]> | THINK
    REASONING: any text without </think>; THINK: text up to and including its first </think>
    answer: %json {...} | /regex/ | "a" | "b" | %lark { the grammar }

A marker the tokenizer holds as one token (an added token, which llguidance reads as special:
never spelt out by other tokens) is allowed as that token (`<[id]>`) as well as as text. The
answer starts right after `</think>` (no whitespace between). Harmony (gpt_oss) answers are
not constrained: its markers are special tokens, refused here with a 400. Text only: never
imports llguidance or the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.sampling_params import StructuredOutput
from gateway.openai import protocol as api
from gateway.openai.reasoning.parsers import THINK_END, THINK_START, HarmonyParser
from gateway.openai.reasoning.plan import ReasoningPlan
from gateway.openai.tools.grammar import JSON_FORMAT


@dataclass(frozen=True)
class MarkerTokens:
    """The token ids of `<think>` and `</think>` where each is a single token, else None."""

    start: int | None
    end: int | None


def after_reasoning(
    plan: ReasoningPlan, constraint: StructuredOutput, markers: MarkerTokens
) -> StructuredOutput:
    """`constraint` applied to the answer after the reasoning; InvalidParameter naming the
    constraint's field when it cannot be."""
    if plan.parser == HarmonyParser.name:
        raise api.InvalidParameter(
            f"{constraint.label} cannot be combined with the gpt_oss reasoning parser: harmony "
            "output is not constrained by this server",
            constraint.label,
        )
    end = _lark_regex(THINK_END)
    lines = [
        "start: open? think answer" if plan.in_reasoning else "start: open think answer | answer",
        "open: " + _marker(THINK_START, markers.start),
        # Text up to and including the first </think>: once that is written the lexeme cannot
        # grow; or text without it, ended by the marker's own token.
        "think: THINK" + ("" if markers.end is None else f" | REASONING <[{markers.end}]>"),
        f"THINK: /(?s:.*){end}/ & ~/(?s:.*){end}(?s:.+)/",
        f"REASONING: /(?s:.*)/ & ~/(?s:.*){end}(?s:.*)/",
        f"answer: {_answer(constraint)}",
    ]
    return StructuredOutput(grammar="\n".join(lines) + "\n", source=constraint.source)


def _marker(text: str, token: int | None) -> str:
    literal = json.dumps(text)
    return literal if token is None else f"<[{token}]> | {literal}"


def _answer(constraint: StructuredOutput) -> str:
    """The constraint as the right-hand side of a Lark rule."""
    constraint.validate()
    if constraint.json is not None or constraint.json_object:
        try:
            schema = json.loads(constraint.json or '{"type": "object"}')
        except ValueError as exc:
            raise api.InvalidParameter(
                f"{constraint.label} has an invalid JSON schema: not valid JSON ({exc})",
                constraint.label,
            ) from None
        if isinstance(schema, dict):
            schema = {"x-guidance": JSON_FORMAT, **schema}
        return f"%json {json.dumps(schema)}"
    if constraint.regex is not None:
        return f"/{_lark_regex(constraint.regex)}/"
    if constraint.choice is not None:
        # JSON string literals are Lark string literals.
        return " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice)
    assert constraint.grammar is not None  # the one kind left
    if "::=" in constraint.grammar:
        raise api.InvalidParameter(
            f"{constraint.label}: with a reasoning parser, a grammar must be written in Lark "
            "(GBNF cannot be nested after the reasoning)",
            constraint.label,
        )
    return "%lark {\n" + constraint.grammar + "\n}"


def _lark_regex(regex: str) -> str:
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
