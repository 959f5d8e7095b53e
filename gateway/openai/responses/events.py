"""A Responses API answer from the chat path's text deltas: the whole Response, or the
documented event stream, each event with its sequence_number: response.created,
response.in_progress, then per output item response.output_item.added, for reasoning (with a
reasoning parser) response.content_part.added, response.reasoning_text.delta...,
response.reasoning_text.done, response.content_part.done, for a message
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, for a call response.function_call_arguments.delta... and .done,
then response.output_item.done; last response.completed (response.incomplete when
max_output_tokens cut it).

The text is read into reasoning, content and calls by the chat path's answer reader, so a
streamed answer and a whole one agree. Never talks to a service.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from gateway.front.http_errors import error_body, log_failure
from gateway.front.sse import named_event
from gateway.openai.reasoning.parsers import ReasoningDelta
from gateway.openai.reasoning.plan import ReasoningPlan
from gateway.openai.reasoning.reader import AnswerReader, read_whole
from gateway.openai.responses import protocol as rapi
from gateway.openai.responses.translate import ResponseHead, item_id, output_items
from gateway.openai.tools.chat import ToolPlan
from gateway.openai.tools.parsers import CallStart, ContentDelta
from gateway.pipeline.text import TextDelta, Usage


async def respond(
    head: ResponseHead,
    tools: ToolPlan | None,
    reasoning: ReasoningPlan | None,
    stream: AsyncIterator[tuple[int, TextDelta]],
) -> rapi.Response:
    """Run the stream to its end; the whole Response."""
    texts: list[str] = []
    reason, usage = None, None
    async for _, delta in stream:
        texts.append(delta.text)
        if delta.finish_reason is not None:
            reason, usage = delta.finish_reason, delta.usage
    answer, _ = read_whole(tools, reasoning, "".join(texts))
    status: rapi.ItemStatus = "incomplete" if reason == "length" else "completed"
    return head.response(status, list(output_items(answer, status)), usage, reason)


# A text item's events by its type: the delta's and the done event's names, and the fields
# both carry besides the text.
_TEXT_EVENTS: dict[str, tuple[str, str, dict[str, object]]] = {
    "message": ("response.output_text.delta", "response.output_text.done", {"logprobs": []}),
    "reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done", {}),
}


class _Events:
    """The events of one streamed response, numbered as they go."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.sequence = 0
        self.output: list[rapi.OutputItem] = []  # finished items
        # The item being written, if text (a message, or reasoning), or a call.
        self.writing: rapi.OutputMessage | rapi.ReasoningItem | None = None
        self.call: rapi.FunctionCallItem | None = None

    def event(self, type_: str, **fields: object) -> bytes:
        event = rapi.ResponseEvent.model_validate(
            {"type": type_, "sequence_number": self.sequence, **fields}
        )
        self.sequence += 1
        return named_event(event.type, event)

    @property
    def index(self) -> int:
        return len(self.output)

    def text(self, text: str) -> list[bytes]:
        return self._write("message", text)

    def thought(self, text: str) -> list[bytes]:
        return self._write("reasoning", text)

    def _write(self, kind: str, text: str) -> list[bytes]:
        """A piece of a text item's one part, opening the item (and closing the one before)
        unless it is the item being written."""
        out = []
        if self.writing is None or self.writing.type != kind:
            out += self.close()
            item: rapi.OutputMessage | rapi.ReasoningItem
            if kind == "message":
                item = rapi.OutputMessage(
                    id=item_id("msg"), status="in_progress", content=[rapi.OutputText(text="")]
                )
            else:
                item = rapi.ReasoningItem(
                    id=item_id("rs"), status="in_progress", content=[rapi.ReasoningText(text="")]
                )
            self.writing = item
            out.append(
                self.event(
                    "response.output_item.added",
                    output_index=self.index,
                    item=item.model_copy(update={"content": []}),
                )
            )
            out.append(
                self.event("response.content_part.added", **self._part(), part=item.content[0])
            )
        delta, _, extra = _TEXT_EVENTS[kind]
        assert self.writing is not None
        self.writing.content[0].text += text
        out.append(self.event(delta, **self._part(), delta=text, **extra))
        return out

    def _part(self) -> dict[str, object]:
        """Where the text item being written is: the fields of its part's events."""
        assert self.writing is not None
        return {"output_index": self.index, "item_id": self.writing.id, "content_index": 0}

    def call_start(self, start: CallStart) -> list[bytes]:
        out = self.close()
        self.call = rapi.FunctionCallItem(
            id=item_id("fc"), call_id=start.id, name=start.name, arguments="", status="in_progress"
        )
        out.append(
            self.event("response.output_item.added", output_index=self.index, item=self.call)
        )
        return out

    def arguments(self, text: str) -> list[bytes]:
        assert self.call is not None
        self.call.arguments += text
        return [
            self.event(
                "response.function_call_arguments.delta",
                output_index=self.index,
                item_id=self.call.id,
                delta=text,
            )
        ]

    def close(self, status: rapi.ItemStatus = "completed") -> list[bytes]:
        """Finish the item being written."""
        out = []
        if self.writing is not None:
            _, done, extra = _TEXT_EVENTS[self.writing.type]
            part = self.writing.content[0]
            out.append(self.event(done, **self._part(), text=part.text, **extra))
            out.append(self.event("response.content_part.done", **self._part(), part=part))
            item, self.writing = self.writing, None
            item.status = status
            out.append(self.event("response.output_item.done", output_index=self.index, item=item))
            self.output.append(item)
        if self.call is not None:
            call, self.call = self.call, None
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    output_index=self.index,
                    item_id=call.id,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            call.status = status
            out.append(self.event("response.output_item.done", output_index=self.index, item=call))
            self.output.append(call)
        return out


async def events(
    head: ResponseHead,
    tools: ToolPlan | None,
    reasoning: ReasoningPlan | None,
    first: tuple[int, TextDelta],
    stream: AsyncGenerator[tuple[int, TextDelta], None],
) -> AsyncGenerator[bytes, None]:
    """The event stream (the first delta already read)."""
    out = _Events(head)
    reader = AnswerReader(tools, reasoning)
    try:
        yield out.event("response.created", response=head.response("in_progress", []))
        yield out.event("response.in_progress", response=head.response("in_progress", []))
        _, delta = first
        usage: Usage | None = None
        reason = None
        while True:
            final = delta.finish_reason is not None
            for answer_event in reader.read(delta.text, final):
                if isinstance(answer_event, ReasoningDelta):
                    chunks = out.thought(answer_event.text)
                elif isinstance(answer_event, ContentDelta):
                    chunks = out.text(answer_event.text)
                elif isinstance(answer_event, CallStart):
                    chunks = out.call_start(answer_event)
                else:
                    chunks = out.arguments(answer_event.text)
                for chunk in chunks:
                    yield chunk
            if final:
                reason, usage = delta.finish_reason, delta.usage
                break
            try:
                _, delta = await anext(stream)
            except StopAsyncIteration:
                break
        status: rapi.ItemStatus = "incomplete" if reason == "length" else "completed"
        if (
            not isinstance(out.writing, rapi.OutputMessage)
            and out.call is None
            and not any(
                isinstance(item, (rapi.OutputMessage, rapi.FunctionCallItem)) for item in out.output
            )
        ):
            for chunk in out.text(""):  # an empty answer is still a message
                yield chunk
        for chunk in out.close(status):
            yield chunk
        response = head.response(status, out.output, usage, reason)
        yield out.event(f"response.{response.status}", response=response)
    except Exception as exc:  # the response has started: the error travels as an event
        log_failure(exc, started=True)
        error = error_body(exc)[1].error
        yield out.event("error", code=error.code, message=error.message, param=error.param)
    finally:
        await stream.aclose()
