"""Tool-call parsers, one per model family's output format, named as vLLM names them:
`hermes` (`<tool_call>{json}</tool_call>`, Qwen2.5 / Qwen3 and the generic format), `llama3_json`
(a JSON object, or several separated by `;`, optionally after `<|python_tag|>`), `mistral`
(`[TOOL_CALLS]` and a JSON array of calls) and `openai` (gpt-oss's harmony commentary messages
to `functions.NAME`).

Each parser is incremental: text goes in as it is generated and events come out (content text,
the start of a call with its id and name, pieces of its arguments), so a streamed answer and a
whole one are read by the same code and agree by construction. A call's arguments are the exact
text the model wrote for them. Parsing only: never decides what a request means.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from gateway.openai.tools import harmony

# `{"name": "...", "arguments": ` (or "parameters", llama3's key): a call object's head, when
# the model writes the name first (the grammars always do).
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallStart:
    index: int  # among this answer's calls
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStart | ArgumentsDelta


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    # Mistral's chat templates refuse any other shape of id: 9 letters or digits.
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _raw_decode(text: str) -> int | None:
    """Where the JSON value at the start of `text` ends, or None if it is not complete (or not
    JSON)."""
    try:
        return _DECODER.raw_decode(text)[1]
    except ValueError:
        return None


class _CallObject:
    """One call object read as it grows: `{"name": ..., "arguments": {...}}`. Its arguments
    stream as the model writes them when the name comes first; otherwise the call comes out
    whole once the object is complete."""

    def __init__(self, index: int, new_id: Callable[[], str]) -> None:
        self.index = index
        self._new_id = new_id
        self._args_start: int | None = None  # where the arguments' text starts, once known
        self._sent = 0  # characters of the arguments sent
        self.started = False

    def advance(self, text: str) -> tuple[list[ToolEvent], int | None]:
        """Events for the object's text so far (`text` starts at its `{`), and where the object
        ends in `text` once it is complete."""
        events: list[ToolEvent] = []
        if self._args_start is None:
            head = _HEAD.match(text)
            if head is None:
                end = _raw_decode(text)
                if end is None:
                    return events, None
                return self._whole(text[:end]), end
            self._args_start = head.end()
            events.append(self._start(json.loads(f'"{head.group(1)}"')))
        args = text[self._args_start :]
        if not self._sent:  # the value starts after any whitespace
            skipped = len(args) - len(args.lstrip())
            self._args_start += skipped
            args = args[skipped:]
        args_end = _raw_decode(args)
        if args_end is None:
            # Not complete: every character so far belongs to the arguments.
            if len(args) > self._sent:
                events.append(ArgumentsDelta(self.index, args[self._sent :]))
                self._sent = len(args)
            return events, None
        if args_end > self._sent:
            events.append(ArgumentsDelta(self.index, args[self._sent : args_end]))
            self._sent = args_end
        # The arguments are done: the object ends at its closing brace (found as JSON, should
        # the model have written more keys after the arguments).
        end = _raw_decode(text)
        return events, end

    def _start(self, name: str) -> CallStart:
        self.started = True
        return CallStart(self.index, self._new_id(), name)

    def _whole(self, text: str) -> list[ToolEvent]:
        try:
            call = json.loads(text)
        except ValueError:
            return []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return []
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return [self._start(call["name"]), ArgumentsDelta(self.index, arguments)]


class ToolCallParser:
    """Reads one answer's text incrementally: feed() each piece as it comes, finish() at the
    end. Subclasses give the format: where calls begin (`_outside`), what may come between or
    after calls (`_after_call`)."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "outside"  # outside | call_start | call | after_call | done
        self._call: _CallObject | None = None
        self.num_calls = 0

    def new_id(self) -> str:
        return openai_call_id()

    def feed(self, text: str) -> list[ToolEvent]:
        self._buffer += text
        events: list[ToolEvent] = []
        while True:
            before = (self._state, len(self._buffer))
            if self._state == "outside":
                events += self._outside(final=False)
            elif self._state == "call_start":
                self._call_start()
            elif self._state == "call":
                events += self._in_call()
            elif self._state == "after_call":
                self._after_call()
            elif self._state == "done":  # what follows the calls is not part of the answer
                self._buffer = ""
            if (self._state, len(self._buffer)) == before:
                return events

    def finish(self) -> list[ToolEvent]:
        """What the text held back turns out to be at the end."""
        if self._state == "outside":
            return self._outside(final=True)
        return []

    # -- shared steps ---------------------------------------------------------------------------

    def _content(self, text: str) -> list[ToolEvent]:
        # Text between or after calls is not an answer of its own.
        return [ContentDelta(text)] if text and not self.num_calls else []

    def _call_start(self) -> None:
        stripped = self._buffer.lstrip()
        if not stripped:
            return
        self._buffer = stripped
        if stripped[0] != "{":
            self._state = "done"  # not a call: the format is broken here
            return
        self._call = _CallObject(self.num_calls, self.new_id)
        self._state = "call"

    def _in_call(self) -> list[ToolEvent]:
        assert self._call is not None
        events, end = self._call.advance(self._buffer)
        if end is None:
            return events
        if self._call.started:
            self.num_calls += 1
        self._call = None
        self._buffer = self._buffer[end:]
        self._state = "after_call"
        return events

    def _after_call(self) -> None:
        self._state = "done"

    def _outside(self, final: bool) -> list[ToolEvent]:
        raise NotImplementedError


class _MarkedCalls(ToolCallParser):
    """Calls begin at a marker; the text before the first one is the answer's content."""

    marker: ClassVar[str]

    def _outside(self, final: bool) -> list[ToolEvent]:
        at = self._buffer.find(self.marker)
        if at >= 0:
            content = self._buffer[:at]
            self._buffer = self._buffer[at + len(self.marker) :]
            self._state = "call_start"
            return self._content(content)
        hold = 0 if final else harmony.partial_suffix(self._buffer, (self.marker,))
        content = self._buffer[: len(self._buffer) - hold]
        self._buffer = self._buffer[len(content) :]
        return self._content(content)


class HermesParser(_MarkedCalls):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated."""

    name = "hermes"
    marker = "<tool_call>"
    closer = "</tool_call>"

    def _after_call(self) -> None:
        stripped = self._buffer.lstrip()
        if self.closer.startswith(stripped):  # not all of it yet
            return
        if stripped.startswith(self.closer):
            self._buffer = stripped[len(self.closer) :]
            self._state = "outside"
        else:
            self._state = "done"


class MistralParser(_MarkedCalls):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. [TOOL_CALLS] is a special token
    that skip_special_tokens removes from the text: an answer that starts with the list of
    calls itself is read as calls too."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    bare_list = "[{"

    def new_id(self) -> str:
        return mistral_call_id()

    def __init__(self) -> None:
        super().__init__()
        self._in_list = False
        self._started = False

    def _outside(self, final: bool) -> list[ToolEvent]:
        if not self._started:
            stripped = self._buffer.lstrip()
            if stripped.startswith(self.bare_list):
                self._buffer = stripped
                self._state = "call_start"
                return []
            if not final and self.bare_list.startswith(stripped):
                return []  # could still be the list
            self._started = True
        return super()._outside(final)

    def _call_start(self) -> None:
        if not self._in_list:
            stripped = self._buffer.lstrip()
            if not stripped:
                return
            if stripped[0] == "[":
                stripped = stripped[1:]
            self._in_list = True
            self._buffer = stripped
        super()._call_start()

    def _after_call(self) -> None:
        stripped = self._buffer.lstrip()
        if not stripped:
            return
        if stripped[0] == ",":
            self._buffer = stripped[1:]
            self._state = "call_start"
        else:
            self._state = "done"


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1+'s JSON calls: the answer is `{"name": ..., "parameters": {...}}` (several
    separated by `;`), optionally after `<|python_tag|>`; any other answer is content."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def _outside(self, final: bool) -> list[ToolEvent]:
        stripped = self._buffer.lstrip()
        if stripped.startswith(self.tag):
            self._buffer = stripped[len(self.tag) :]
            self._state = "call_start"
            return []
        if stripped.startswith("{"):
            self._state = "call_start"
            return []
        if not final and (not stripped or self.tag.startswith(stripped)):
            return []  # could still become calls
        # Content from here on: this format has calls only at the start.
        self._state = "content"
        return self._take_content()

    def feed(self, text: str) -> list[ToolEvent]:
        if self._state == "content":
            self._buffer += text
            return self._take_content()
        return super().feed(text)

    def _take_content(self) -> list[ToolEvent]:
        content, self._buffer = self._buffer, ""
        return self._content(content)

    def _after_call(self) -> None:
        stripped = self._buffer.lstrip()
        if not stripped:
            return
        if stripped[0] == ";":
            self._buffer = stripped[1:]
            self._state = "call_start"
        else:
            self._state = "done"


class HarmonyToolParser(ToolCallParser):
    """gpt-oss's harmony: a message to `functions.NAME` (`<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`) is a call, its body the
    arguments as written; the body of any other message (final, a commentary preamble), and text
    outside messages, is content. Headers are never content."""

    name = "openai"

    def __init__(self) -> None:
        super().__init__()
        self._reader = harmony.HarmonyReader()
        self._calling = False

    def feed(self, text: str) -> list[ToolEvent]:
        return self._events(self._reader.feed(text))

    def finish(self) -> list[ToolEvent]:
        return self._events(self._reader.finish())

    def _events(self, items: list[harmony.Item]) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        for item in items:
            if isinstance(item, harmony.Header):
                self._calling = item.recipient.startswith(harmony.FUNCTIONS)
                if self._calling:
                    name = item.recipient[len(harmony.FUNCTIONS) :]
                    events.append(CallStart(self.num_calls, self.new_id(), name))
                    self.num_calls += 1
            elif isinstance(item, harmony.MessageEnd):
                self._calling = False
            elif self._calling:
                events.append(ArgumentsDelta(self.num_calls - 1, item.text))
            else:
                events += self._content(item.text)
        return events


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, MistralParser, HarmonyToolParser)
}


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass
class ParsedAnswer:
    content: str
    calls: list[ParsedCall]


def parse_whole(parser: ToolCallParser, text: str) -> ParsedAnswer:
    """A whole answer read at once, as feed() and finish() read it in pieces."""
    return collect(parser.feed(text) + parser.finish())


def collect(events: list[ToolEvent], into: ParsedAnswer | None = None) -> ParsedAnswer:
    """Events gathered into content and calls."""
    answer = into or ParsedAnswer("", [])
    for event in events:
        if isinstance(event, ContentDelta):
            answer.content += event.text
        elif isinstance(event, CallStart):
            answer.calls.append(ParsedCall(event.id, event.name, ""))
        else:
            answer.calls[event.index].arguments += event.text
    return answer
