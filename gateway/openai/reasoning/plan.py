"""Whether and how a chat request's answers are split into reasoning and answer: the server's
--reasoning-parser (else the chat template's reasoning format), and for the `<think>` formats
where the rendered prompt leaves the model: inside an open `<think>` (the answer begins in
reasoning), after a closed `<think></think>` (e.g. enable_thinking false: no reasoning at
all), or neither (the parser's own default).

Decides only; the splitting is parsers.py's, the grammar after the reasoning grammar.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.openai.reasoning.parsers import (
    PARSERS,
    THINK_END,
    THINK_START,
    DeepSeekR1Parser,
    HarmonyParser,
    ReasoningParser,
    ThinkParser,
)

NO_PARSER = "none"


@dataclass(frozen=True)
class ReasoningPlan:
    """How each answer of a request is split."""

    parser: str  # a PARSERS name
    in_reasoning: bool  # think formats: the answer begins inside the reasoning

    def new_parser(self, raw_calls: bool) -> ReasoningParser:
        """A parser for one answer; `raw_calls`: harmony's calls go on whole to harmony's own
        tool parser."""
        cls = PARSERS[self.parser]
        if issubclass(cls, ThinkParser):
            return cls(self.in_reasoning)
        return HarmonyParser(raw_calls)

    @property
    def markers(self) -> tuple[str, ...]:
        return PARSERS[self.parser].markers

    @property
    def needs_special_tokens(self) -> bool:
        """The parser reads special tokens (harmony's markers), which the text must keep."""
        return PARSERS[self.parser].needs_special_tokens


def reasoning_plan(
    server_parser: str | None, template_format: str, prompt: str
) -> ReasoningPlan | None:
    """The plan for a chat request whose rendered prompt is `prompt`, or None when its answer
    is not split (no parser, or the prompt closed the reasoning block)."""
    name = server_parser or template_format
    if not name or name == NO_PARSER:
        return None
    if name == HarmonyParser.name:
        return ReasoningPlan(name, in_reasoning=False)
    tail = prompt.rstrip()
    if tail.endswith(THINK_END):
        return None
    in_reasoning = tail.endswith(THINK_START) or name == DeepSeekR1Parser.name
    return ReasoningPlan(name, in_reasoning)
