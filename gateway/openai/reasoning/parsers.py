"""Reasoning parsers, named as vLLM names them: `deepseek_r1` and `qwen3` read
`<think>reasoning</think>answer`, `gpt_oss` reads harmony's channels
(`<|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>answer`,
read by tools/harmony.py).

Each parser is incremental: text goes in as it is generated (a marker may arrive split over any
number of pieces) and comes out as reasoning pieces and answer pieces, so a streamed answer and
a whole one are split by the same code and agree by construction. Text held back is only ever
a possible start of a marker. Splitting only: never decides what a request means, and never
reads tool calls (the answer part goes on to the tool reader; harmony's calls pass to it whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gateway.openai.tools import harmony
from gateway.openai.tools.parsers import ContentDelta

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ReasoningDelta:
    text: str


Piece = ReasoningDelta | ContentDelta


def _pieces(reasoning: str, content: str) -> list[Piece]:
    out: list[Piece] = []
    if reasoning:
        out.append(ReasoningDelta(reasoning))
    if content:
        out.append(ContentDelta(content))
    return out


class ReasoningParser:
    """Splits one answer's text: feed() each piece as it comes, finish() at the end, holding
    back only a marker's beginning."""

    name: ClassVar[str]
    # The markers are special tokens, which the text keeps only when asked to.
    needs_special_tokens: ClassVar[bool] = False
    # The format's markers (a structured output grammar allows each as its own token).
    markers: ClassVar[tuple[str, ...]]

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError


class ThinkParser(ReasoningParser):
    """`<think>reasoning</think>answer`. The answer begins in reasoning when `in_reasoning`
    (the prompt opened the block, or the model is one that starts thinking without writing
    the tag); otherwise a leading `<think>` opens it and any other start is all answer.
    Whitespace between `</think>` and the answer is the template's, not the answer's."""

    name = "think"
    markers = (THINK_START, THINK_END)

    def __init__(self, in_reasoning: bool) -> None:
        self._buffer = ""
        self._default = "reasoning" if in_reasoning else "content"
        self._state = "start"  # start | reasoning | after_end | content

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._step(final=False)

    def finish(self) -> list[Piece]:
        return self._step(final=True)

    def _step(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(THINK_START):
                self._buffer = stripped[len(THINK_START) :]
                self._state = "reasoning"
            elif not final and THINK_START.startswith(stripped):
                return out  # whitespace so far, or the tag's beginning
            else:
                self._state = self._default
        if self._state == "reasoning":
            at = self._buffer.find(THINK_END)
            if at < 0:
                hold = 0 if final else harmony.partial_suffix(self._buffer, (THINK_END,))
                reasoning = self._buffer[: len(self._buffer) - hold]
                self._buffer = self._buffer[len(reasoning) :]
                return _pieces(reasoning, "")
            out += _pieces(self._buffer[:at], "")
            self._buffer = self._buffer[at + len(THINK_END) :]
            self._state = "after_end"
        if self._state == "after_end":
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return out
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return out + _pieces("", content)


class DeepSeekR1Parser(ThinkParser):
    """DeepSeek-R1: its template opens `<think>` in the prompt, so an answer is reasoning
    until `</think>` whether or not the model writes the tag again."""

    name = "deepseek_r1"


class Qwen3Parser(ThinkParser):
    """Qwen3: the model writes `<think>` itself when it thinks; an answer without it (e.g.
    with enable_thinking false) is all answer."""

    name = "qwen3"


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony format (tools/harmony.py reads its messages): the analysis channel's
    body is reasoning, every other message's body is answer, text outside messages is answer.
    A message to a recipient (a call) is answer too, or with `raw_calls` (the answer goes on to
    harmony's own tool parser) passed on whole, header and end marker included, so that parser
    reads the call."""

    name = "gpt_oss"
    needs_special_tokens = True
    markers = harmony.MARKERS

    def __init__(self, raw_calls: bool = False) -> None:
        self._reader = harmony.HarmonyReader()
        self._raw_calls = raw_calls
        self._kind = "answer"  # the current message's: reasoning | answer | call

    def feed(self, text: str) -> list[Piece]:
        return self._pieces(self._reader.feed(text))

    def finish(self) -> list[Piece]:
        return self._pieces(self._reader.finish())

    def _pieces(self, items: list[harmony.Item]) -> list[Piece]:
        out: list[Piece] = []
        for item in items:
            if isinstance(item, harmony.Header):
                if item.recipient and self._raw_calls:
                    self._kind = "call"
                    out.append(ContentDelta(item.text))
                elif item.channel == harmony.ANALYSIS and not item.recipient:
                    self._kind = "reasoning"
                else:
                    self._kind = "answer"
            elif isinstance(item, harmony.MessageEnd):
                if self._kind == "call" and item.marker:
                    out.append(ContentDelta(item.marker))
                self._kind = "answer"
            elif isinstance(item, harmony.Plain):
                out.append(ContentDelta(item.text))
            elif self._kind == "reasoning":
                out += _pieces(item.text, "")
            else:
                out += _pieces("", item.text)
        return out


PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1Parser, Qwen3Parser, HarmonyParser)
}
