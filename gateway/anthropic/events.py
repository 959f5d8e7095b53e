"""A Messages API answer from the chat path's text deltas: the whole Message, or Anthropic's
event stream: message_start, ping, per content block content_block_start,
content_block_delta... (thinking_delta for a thinking block, text_delta, or input_json_delta for
a tool_use block) and content_block_stop, then message_delta (stop reason, output tokens) and
message_stop.

The text is read into thinking, text and tool_use blocks by the chat path's answer reader, so a
streamed answer and a whole one agree. Never talks to a service.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from gateway.anthropic import protocol as aapi
from gateway.anthropic.translate import MessageHead, content_blocks, error_body, stop_reason
from gateway.front.http_errors import log_failure
from gateway.front.sse import named_event
from gateway.openai.reasoning.parsers import ReasoningDelta
from gateway.openai.reasoning.plan import ReasoningPlan
from gateway.openai.reasoning.reader import AnswerEvent, AnswerReader, read_whole
from gateway.openai.tools.chat import ToolPlan
from gateway.openai.tools.parsers import CallStart, ContentDelta
from gateway.pipeline.text import TextDelta


async def respond(
    head: MessageHead,
    tools: ToolPlan | None,
    reasoning: ReasoningPlan | None,
    stream: AsyncIterator[tuple[int, TextDelta]],
) -> aapi.Message:
    """Run the stream to its end; the whole Message."""
    texts: list[str] = []
    last = TextDelta("")
    async for _, delta in stream:
        texts.append(delta.text)
        last = delta
    answer, _ = read_whole(tools, reasoning, "".join(texts))
    reason = stop_reason(last.finish_reason, last.stop_matched, len(answer.parsed.calls))
    blocks = content_blocks(answer, head.thinking)
    return head.message(blocks, reason, last.stop_matched, last.usage)


def _event(type_: str, **fields: object) -> bytes:
    return named_event(type_, aapi.StreamEvent.model_validate({"type": type_, **fields}))


class _Blocks:
    """The content blocks of one streamed message, opened and closed as the events come."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking  # reasoning is written as thinking blocks (else left out)
        self.count = 0  # blocks started
        self.answered = False  # a text or tool_use block started
        self.open: str | None = None  # the type of the block being written

    def start(self, block: aapi.OutputBlock) -> list[bytes]:
        out = self.close()
        self.open = block.type
        self.count += 1
        self.answered = self.answered or block.type != "thinking"
        out.append(_event("content_block_start", index=self.count - 1, content_block=block))
        return out

    def delta(self, delta: aapi.EventDelta) -> bytes:
        return _event("content_block_delta", index=self.count - 1, delta=delta)

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.count - 1)]

    def read(self, event: AnswerEvent) -> list[bytes]:
        if isinstance(event, ReasoningDelta):
            if not self.thinking:
                return []
            out = [] if self.open == "thinking" else self.start(aapi.ThinkingContent(thinking=""))
            out.append(self.delta(aapi.EventDelta(type="thinking_delta", thinking=event.text)))
            return out
        if isinstance(event, ContentDelta):
            out = [] if self.open == "text" else self.start(aapi.TextContent(text=""))
            out.append(self.delta(aapi.EventDelta(type="text_delta", text=event.text)))
            return out
        if isinstance(event, CallStart):
            return self.start(aapi.ToolUseContent(id=event.id, name=event.name, input={}))
        return [self.delta(aapi.EventDelta(type="input_json_delta", partial_json=event.text))]


async def events(
    head: MessageHead,
    tools: ToolPlan | None,
    reasoning: ReasoningPlan | None,
    first: tuple[int, TextDelta],
    stream: AsyncGenerator[tuple[int, TextDelta], None],
) -> AsyncGenerator[bytes, None]:
    """The event stream (the first delta already read)."""
    blocks = _Blocks(head.thinking)
    reader = AnswerReader(tools, reasoning)
    try:
        yield _event("message_start", message=head.message([]))
        yield _event("ping")
        _, delta = first
        while True:
            final = delta.finish_reason is not None
            for answer_event in reader.read(delta.text, final):
                for chunk in blocks.read(answer_event):
                    yield chunk
            if final:
                break
            try:
                _, delta = await anext(stream)
            except StopAsyncIteration:
                break
        if not blocks.answered:  # an empty answer is still a text block
            for chunk in blocks.start(aapi.TextContent(text="")):
                yield chunk
        for chunk in blocks.close():
            yield chunk
        reason = stop_reason(delta.finish_reason, delta.stop_matched, reader.num_calls)
        output_tokens = delta.usage.completion_tokens if delta.usage is not None else 0
        yield _event(
            "message_delta",
            delta=aapi.EventDelta(
                stop_reason=reason,
                stop_sequence=delta.stop_matched if reason == "stop_sequence" else None,
            ),
            usage=aapi.DeltaUsage(output_tokens=output_tokens),
        )
        yield _event("message_stop")
    except Exception as exc:  # the message has started: the error travels as an event
        log_failure(exc, started=True)
        yield _event("error", error=error_body(exc)[1].error)
    finally:
        await stream.aclose()
