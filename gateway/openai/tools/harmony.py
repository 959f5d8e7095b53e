"""Harmony, gpt-oss's output format: messages `[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT]
[ <|constrain|>TYPE]<|message|>BODY` each ending at `<|end|>`, `<|return|>` or `<|call|>` (the
recipient may also follow the role: `<|start|>assistant to=functions.NAME<|channel|>...`, as
gpt-oss's chat template writes earlier calls), e.g.

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
    <|call|><|start|>assistant<|channel|>final<|message|>answer<|return|>

Its markers, and the incremental reader of its messages, shared by the gpt_oss reasoning parser
and the `openai` tool-call parser (as vLLM names both); grammar.py writes harmony grammars.
Reading only: never decides what a message means to an API.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

START = "<|start|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
HEADS = (START, CHANNEL)
ENDS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, END, RETURN, CALL)
ANALYSIS = "analysis"
FUNCTIONS = "functions."  # the recipient prefix of a call of a developer's function
RECIPIENT = "to="
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Header:
    """A message's header, read whole: its channel, recipient ("" for none) and text as
    written (the markers included, through `<|message|>`)."""

    channel: str
    recipient: str
    text: str


@dataclass
class Body:
    text: str


@dataclass
class MessageEnd:
    marker: str  # "" when the text ended inside the body


@dataclass
class Plain:
    """Text outside any message (a model that wrote no harmony)."""

    text: str


Item = Header | Body | MessageEnd | Plain


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins one of `markers` (text to hold back)."""
    longest = max(len(m) for m in markers) - 1
    for size in range(min(len(text), longest), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0


class HarmonyReader:
    """Harmony text read as it comes: feed() each piece, finish() at the end. Holds back only
    what may still be a marker (or a header without its `<|message|>` yet); whitespace before
    a header is the format's, not text. Text outside messages is Plain (a model that wrote no
    harmony, or text between messages)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "start"  # start | outside | header | body

    def feed(self, text: str) -> list[Item]:
        self._buffer += text
        return self._step(final=False)

    def finish(self) -> list[Item]:
        return self._step(final=True)

    def _step(self, final: bool) -> list[Item]:
        out: list[Item] = []
        while True:
            if self._state == "start":
                # The prompt ends with `<|start|>assistant`: the first header may begin with
                # its recipient (` to=functions.NAME<|channel|>commentary json<|message|>`).
                stripped = self._buffer.lstrip()
                if not final and (not stripped or RECIPIENT.startswith(stripped)):
                    return out
                if stripped.startswith(RECIPIENT):
                    self._buffer = stripped
                    self._state = "header"
                else:
                    self._state = "outside"
            if self._state == "outside":
                heads = [at for head in HEADS if (at := self._buffer.find(head)) >= 0]
                if not heads:
                    hold = 0 if final else partial_suffix(self._buffer, HEADS)
                    plain = self._buffer[: len(self._buffer) - hold]
                    if not plain.strip() and not final:
                        return out  # whitespace so far: a header's, or the text's start
                    self._buffer = self._buffer[len(plain) :]
                    if plain.strip():
                        out.append(Plain(plain))
                    return out
                at = min(heads)
                if self._buffer[:at].strip():
                    out.append(Plain(self._buffer[:at]))
                self._buffer = self._buffer[at:]
                self._state = "header"
            if self._state == "header":
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    if final:  # a header cut off: nothing of the answer in it
                        if not any(head in self._buffer for head in HEADS):
                            out.append(Plain(self._buffer))  # only looked like a recipient
                        self._buffer = ""
                    return out
                text = self._buffer[: at + len(MESSAGE)]
                self._buffer = self._buffer[len(text) :]
                out.append(Header(_channel(text), _recipient(text), text))
                self._state = "body"
            ends = [(at, end) for end in ENDS if (at := self._buffer.find(end)) >= 0]
            if not ends:
                hold = 0 if final else partial_suffix(self._buffer, ENDS)
                body = self._buffer[: len(self._buffer) - hold]
                self._buffer = self._buffer[len(body) :]
                if body:
                    out.append(Body(body))
                if final:
                    out.append(MessageEnd(""))
                return out
            at, end = min(ends)
            if at:
                out.append(Body(self._buffer[:at]))
            out.append(MessageEnd(end))
            self._buffer = self._buffer[at + len(end) :]
            self._state = "outside"


def _channel(header: str) -> str:
    """The channel a header names: the word after `<|channel|>`."""
    _, found, rest = header.partition(CHANNEL)
    words = rest.split("<|", 1)[0].split() if found else []
    return words[0] if words else ""


def _recipient(header: str) -> str:
    """The `to=` of a header, written after the role or after the channel."""
    found = _RECIPIENT.search(header)
    return found.group(1) if found else ""
