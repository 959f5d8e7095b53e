"""Reasoning parsers, named as vLLM names them: `deepseek_r1` and `qwen3` read
`<think>reasoning</think>answer`, `gpt_oss` reads harmony's channels
(`<|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>answer`).

Each parser is incremental: text goes in as it is generated (a marker may arrive split over any
number of pieces) and comes out as reasoning pieces and answer pieces, so a streamed answer and
a whole one are split by the same code and agree by construction. Text held back is only ever
a possible start of a marker. Splitting only: never decides what a request means, and never
reads tool calls (the answer part goes on to the tool reader).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gateway.openai.tools.parsers import ContentDelta

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ReasoningDelta:
    text: str


Piece = ReasoningDelta | ContentDelta


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `markers` (text to hold back)."""
    longest = max(len(m) for m in markers) - 1
    for size in range(min(len(text), longest), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0


def _pieces(reasoning: str, content: str) -> list[Piece]:
    out: list[Piece] = []
    if reasoning:
        out.append(ReasoningDelta(reasoning))
    if content:
        out.append(ContentDelta(content))
    return out


class ReasoningParser:
    """Splits one answer's text: feed() each piece as it comes, finish() at the end.
    Subclasses read what is buffered (`_step`), holding back only a marker's beginning."""

    name: ClassVar[str]
    # The markers are special tokens, which the text keeps only when asked to.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._step(final=False)

    def finish(self) -> list[Piece]:
        return self._step(final=True)

    def _step(self, final: bool) -> list[Piece]:
        raise NotImplementedError


class ThinkParser(ReasoningParser):
    """`<think>reasoning</think>answer`. The answer begins in reasoning when `in_reasoning`
    (the prompt opened the block, or the model is one that starts thinking without writing
    the tag); otherwise a leading `<think>` opens it and any other start is all answer.
    Whitespace between `</think>` and the answer is the template's, not the answer's."""

    name = "think"

    def __init__(self, in_reasoning: bool) -> None:
        super().__init__()
        self._default = "reasoning" if in_reasoning else "content"
        self._state = "start"  # start | reasoning | after_end | content

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
                hold = 0 if final else _partial_suffix(self._buffer, (THINK_END,))
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
    """gpt-oss's harmony format: messages `[<|start|>assistant]<|channel|>NAME[ to=...]
    [<|constrain|>...]<|message|>BODY` ending at `<|end|>`, `<|return|>` or `<|call|>`. The
    analysis channel is reasoning; every other channel's body is answer. Text that does not
    begin with a harmony header is all answer."""

    name = "gpt_oss"
    needs_special_tokens = True
    HEADS = ("<|start|>", "<|channel|>")
    MESSAGE = "<|message|>"
    ENDS = ("<|end|>", "<|return|>", "<|call|>")
    REASONING_CHANNEL = "analysis"

    def __init__(self) -> None:
        super().__init__()
        self._state = "header"  # header | body | plain
        self._reasoning = False  # the current body's channel is analysis

    def _step(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self._state == "plain":
                content, self._buffer = self._buffer, ""
                return out + _pieces("", content)
            if self._state == "header":
                stripped = self._buffer.lstrip()
                if not stripped:
                    return out
                if not stripped.startswith(self.HEADS):
                    if not final and any(h.startswith(stripped) for h in self.HEADS):
                        return out  # a header's first characters
                    self._state = "plain"  # not harmony: the model wrote plain text
                    continue
                at = stripped.find(self.MESSAGE)
                if at < 0:
                    if final:  # a header cut off: nothing of the answer in it
                        self._buffer = ""
                    return out
                self._reasoning = self._channel(stripped[:at]) == self.REASONING_CHANNEL
                self._buffer = stripped[at + len(self.MESSAGE) :]
                self._state = "body"
            if self._state == "body":
                ends = [(at, end) for end in self.ENDS if (at := self._buffer.find(end)) >= 0]
                if not ends:
                    hold = 0 if final else _partial_suffix(self._buffer, self.ENDS)
                    body = self._buffer[: len(self._buffer) - hold]
                    self._buffer = self._buffer[len(body) :]
                    return out + self._body(body)
                at, end = min(ends)
                out += self._body(self._buffer[:at])
                self._buffer = self._buffer[at + len(end) :]
                self._state = "header"

    def _body(self, text: str) -> list[Piece]:
        return _pieces(text, "") if self._reasoning else _pieces("", text)

    @staticmethod
    def _channel(header: str) -> str:
        """The channel a header names: the word after `<|channel|>`."""
        _, found, rest = header.partition("<|channel|>")
        if not found:
            return ""
        words = rest.split("<|", 1)[0].split()
        return words[0] if words else ""


PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1Parser, Qwen3Parser, HarmonyParser)
}
