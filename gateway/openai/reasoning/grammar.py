"""Structured output after the reasoning: a request's constraint (response_format, a regex, a
choice, a Lark grammar, or the tools' grammar) rewritten as one llguidance Lark grammar that
lets the model think freely and then holds the answer to the constraint, so the engine
compiles and enforces it like any other grammar (no engine change).

    start: open? think answer              (the answer begins in reasoning)
    start: open think answer | answer      (qwen3 outside a block: thinking is optional)
    open: <[id]> | "<think>"
    think: THINK | THINK_FREE <[id]>
    THINK: text up to and including its first </think>; THINK_FREE: any text without </think>
    answer: %json {...} | /regex/ | "a" | "b" | %lark { the grammar }

Harmony (gpt_oss): any number of free analysis messages, then the final channel's body held
to the constraint (tools/grammar.py writes harmony grammars). A marker the tokenizer holds as
one token (an added token, which llguidance reads as special: never spelt out by other tokens)
is allowed as that token (`<[id]>`) as well as as text. The answer starts right after `</think>` or
`<|message|>` (no whitespace between). Text only: never imports llguidance or the engine.
"""

from __future__ import annotations

import json

from common.sampling_params import StructuredOutput
from gateway.openai import protocol as api
from gateway.openai.reasoning.parsers import THINK_END, THINK_START, HarmonyParser
from gateway.openai.reasoning.plan import ReasoningPlan
from gateway.openai.tools.grammar import (
    JSON_FORMAT,
    MarkerTokens,
    final_lines,
    free_text,
    lark_regex,
)


def after_reasoning(
    plan: ReasoningPlan, constraint: StructuredOutput, markers: MarkerTokens
) -> StructuredOutput:
    """`constraint` applied to the answer after the reasoning; InvalidParameter naming the
    constraint's field when it cannot be."""
    answer = _answer(constraint)
    if plan.parser == HarmonyParser.name:
        lines = final_lines(markers, answer)
    else:
        in_block = plan.in_reasoning
        lines = [
            "start: open? think answer" if in_block else "start: open think answer | answer",
            "open: " + markers.lark(THINK_START),
            *free_text("think", THINK_END, (THINK_END,), markers),
            f"answer: {answer}",
        ]
    return StructuredOutput(grammar="\n".join(lines) + "\n", source=constraint.source)


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
        return f"/{lark_regex(constraint.regex)}/"
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
