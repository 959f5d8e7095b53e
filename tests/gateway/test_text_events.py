"""Streamed events that carry only text are spliced from a per-choice template
(gateway/openai/completions.py `_TextEvents`): they must be byte for byte what serializing the whole
event gives, whatever the text (quotes, escapes, control characters, non-ASCII, the placeholder
itself), for chat and text completions, and events with more than text still come whole. Every
event is one line to readers that break lines where `str.splitlines` does (httpx's `aiter_lines`):
the line separators JSON leaves as they are come escaped."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest

from common.sampling_params import SamplingParams
from gateway.front.sse import DONE, event, named_event
from gateway.openai import protocol as api
from gateway.openai.completions import Plan, _TextEvents, events
from gateway.pipeline.text import TextDelta, TextRequest, Usage

TEXTS = [
    "",
    "plain",
    ' "quoted" ',
    "back\\slash",
    "line\nbreak\ttab\r",
    "\x00\x01\x1f\x7f",
    "é中文🙂",
    "\u2028\u2029\x85",
    "</script>",
    "\ufffd",
    _TextEvents._SLOT,
]


def _completion_event(index: int, text: str) -> bytes:
    return event(
        api.CompletionResponse(
            id="cmpl-1",
            created=7,
            model="m",
            choices=[api.CompletionChoice(index=index, text=text)],
        )
    )


@pytest.mark.parametrize("text", TEXTS)
def test_a_spliced_event_equals_the_whole_one(text):
    spliced = _TextEvents(_completion_event)
    for index in (0, 3, 0):
        assert spliced(index, text) == _completion_event(index, text)


def test_a_template_the_placeholder_appears_in_twice_is_not_used():
    def make(index: int, text: str) -> bytes:
        return event(
            api.CompletionResponse(
                id="cmpl-1",
                created=7,
                model=_TextEvents._SLOT,  # the placeholder twice in the event
                choices=[api.CompletionChoice(index=index, text=text)],
            )
        )

    spliced = _TextEvents(make)
    for text in TEXTS:
        assert spliced(1, text) == make(1, text)


def _plan(chat: bool, n: int = 1) -> Plan:
    request = TextRequest([1, 2], SamplingParams(n=n, max_tokens=4))
    return Plan(chat, "id-1", "m", [request], n, False, True, 7)


async def _deltas(items) -> AsyncGenerator[tuple[int, TextDelta], None]:
    for item in items:
        yield item


def _run(plan: Plan, items: list[tuple[int, TextDelta]]) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [e async for e in events(plan, items[0], _deltas(items[1:]))]

    return asyncio.run(collect())


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_events_are_the_whole_events(chat):
    usage = Usage(2, 4)
    items = [(i % 2, TextDelta(t)) for i, t in enumerate(TEXTS)]
    items += [(0, TextDelta("end", finish_reason="length", usage=usage))]
    items += [(1, TextDelta("", finish_reason="stop", usage=usage))]
    got = _run(_plan(chat, n=2), items)
    want: list[bytes] = []
    if chat:
        want.append(
            event(
                api.ChatCompletionChunk(
                    id="id-1",
                    created=7,
                    model="m",
                    choices=[
                        api.ChatChunkChoice(
                            index=i, delta=api.DeltaMessage(role="assistant", content="")
                        )
                        for i in range(2)
                    ],
                )
            )
        )
    for index, delta in items:
        if chat:
            body: api.ChatCompletionChunk | api.CompletionResponse = api.ChatCompletionChunk(
                id="id-1",
                created=7,
                model="m",
                choices=[
                    api.ChatChunkChoice(
                        index=index,
                        delta=api.DeltaMessage(content=delta.text),
                        finish_reason=delta.finish_reason,
                    )
                ],
            )
        else:
            body = api.CompletionResponse(
                id="id-1",
                created=7,
                model="m",
                choices=[
                    api.CompletionChoice(
                        index=index, text=delta.text, finish_reason=delta.finish_reason
                    )
                ],
            )
        want.append(event(body))
    assert got[: len(want)] == want
    usage_event = json.loads(got[len(want)].removeprefix(b"data: "))
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 8
    assert got[len(want) + 1 :] == [DONE]


# Characters str.splitlines breaks lines at that JSON need not escape (U+000B, U+000C and
# U+001C-U+001E are control characters JSON escapes anyway).
LINE_SEPARATORS = "a\x85b\u2028c\u2029d\x0be\x1cf"


@pytest.mark.parametrize("chat", [True, False])
def test_every_event_is_one_line_to_a_line_reader(chat):
    texts = [LINE_SEPARATORS, "\u2028", "x\x85"]
    items = [(0, TextDelta(t)) for t in texts]
    items += [(0, TextDelta(LINE_SEPARATORS, finish_reason="length", usage=Usage(2, 4)))]
    got = _run(_plan(chat), items)
    lines = [line for line in b"".join(got).decode().splitlines() if line]
    assert len(lines) == len(got)  # each event one data line, whole
    read = []
    # Past the chat's opening event, before the usage event and [DONE].
    for line in lines[1:-2] if chat else lines[:-2]:
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        read.append(choice["delta"]["content"] if chat else choice["text"])
    assert read == [*texts, LINE_SEPARATORS]


def test_a_named_event_is_one_line_to_a_line_reader():
    body = api.CompletionChoice(index=0, text=LINE_SEPARATORS)
    lines = named_event("message_delta", body).decode().splitlines()
    assert lines[0] == "event: message_delta" and lines[2:] == [""]
    assert json.loads(lines[1].removeprefix("data: "))["text"] == LINE_SEPARATORS
