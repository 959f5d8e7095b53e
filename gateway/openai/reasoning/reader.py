"""One choice's generated text read as it comes: first split into reasoning and answer (when
the request has a reasoning plan), then the answer part read into content and tool calls
(tools/chat.py's ToolReader), so a call is only ever read from the answer, never from the
model's thinking. Every API that answers from the chat path (chat completions, Responses,
Messages) reads its choices through this one reader.

Reading only: never builds a response body.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.openai.reasoning.parsers import ReasoningDelta
from gateway.openai.reasoning.plan import ReasoningPlan
from gateway.openai.tools.chat import ToolPlan, ToolReader
from gateway.openai.tools.parsers import (
    ContentDelta,
    HarmonyToolParser,
    ParsedAnswer,
    ToolEvent,
    collect,
)

AnswerEvent = ReasoningDelta | ToolEvent


class AnswerReader:
    """Reasoning, content and calls of one choice."""

    def __init__(self, tools: ToolPlan | None, reasoning: ReasoningPlan | None) -> None:
        self._tools = ToolReader(tools)
        raw_calls = tools is not None and tools.parser is HarmonyToolParser
        self._reasoning = reasoning.new_parser(raw_calls) if reasoning is not None else None

    def read(self, text: str, final: bool) -> list[AnswerEvent]:
        if self._reasoning is None:
            return list(self._tools.read(text, final))
        pieces = self._reasoning.feed(text)
        if final:
            pieces += self._reasoning.finish()
        events: list[AnswerEvent] = [p for p in pieces if isinstance(p, ReasoningDelta)]
        answer = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
        # The tool reader sees the answer's text alone (and its end, to release what it holds).
        if answer or final:
            events += self._tools.read(answer, final)
        return events

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls

    def finish_reason(self, reason: str) -> str:
        return self._tools.finish_reason(reason)


@dataclass
class Answer:
    """A whole answer: its reasoning (None if it has none), content and calls."""

    reasoning: str | None
    parsed: ParsedAnswer


def read_whole(
    tools: ToolPlan | None, reasoning: ReasoningPlan | None, text: str
) -> tuple[Answer, AnswerReader]:
    """A whole answer read at once, as streamed pieces are; the reader, for its finish
    reason."""
    reader = AnswerReader(tools, reasoning)
    events = reader.read(text, final=True)
    thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    parsed = collect([e for e in events if not isinstance(e, ReasoningDelta)])
    return Answer(thought or None, parsed), reader
