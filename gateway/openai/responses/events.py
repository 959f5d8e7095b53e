"""A Responses API answer from the chat path's text deltas: the whole Response, or the
documented event stream, each event with its sequence_number: response.created,
response.in_progress, then per output item response.output_item.added, for a message
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, for a call response.function_call_arguments.delta... and .done,
then response.output_item.done; last response.completed (response.incomplete when
max_output_tokens cut it).

The text is read into content and calls by the chat path's tool reader, so a streamed answer
and a whole one agree. Never talks to a service.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from gateway.front.http_errors import error_body, log_failure
from gateway.front.sse import named_event
from gateway.openai.responses import protocol as rapi
from gateway.openai.responses.translate import ResponseHead, item_id, output_items
from gateway.openai.tools.chat import ToolPlan, ToolReader
from gateway.openai.tools.parsers import CallStart, ContentDelta, collect
from gateway.pipeline.text import TextDelta, Usage


async def respond(
    head: ResponseHead, tools: ToolPlan | None, stream: AsyncIterator[tuple[int, TextDelta]]
) -> rapi.Response:
    """Run the stream to its end; the whole Response."""
    reader = ToolReader(tools)
    texts: list[str] = []
    reason, usage = None, None
    async for _, delta in stream:
        texts.append(delta.text)
        if delta.finish_reason is not None:
            reason, usage = delta.finish_reason, delta.usage
    answer = collect(reader.read("".join(texts), final=True))
    status: rapi.ItemStatus = "incomplete" if reason == "length" else "completed"
    return head.response(status, list(output_items(answer, status)), usage, reason)


class _Events:
    """The events of one streamed response, numbered as they go."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.sequence = 0
        self.output: list[rapi.OutputItem] = []  # finished items
        self.message: rapi.OutputMessage | None = None  # the item being written, if text
        self.call: rapi.FunctionCallItem | None = None  # the item being written, if a call

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
        out = []
        if self.message is None:
            out += self.close()
            self.message = rapi.OutputMessage(id=item_id("msg"), status="in_progress", content=[])
            out.append(
                self.event("response.output_item.added", output_index=self.index, item=self.message)
            )
            out.append(
                self.event(
                    "response.content_part.added",
                    output_index=self.index,
                    item_id=self.message.id,
                    content_index=0,
                    part=rapi.OutputText(text=""),
                )
            )
            self.message.content.append(rapi.OutputText(text=""))
        self.message.content[0].text += text
        out.append(
            self.event(
                "response.output_text.delta",
                output_index=self.index,
                item_id=self.message.id,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

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
        if self.message is not None:
            message, self.message = self.message, None
            part = message.content[0]
            common = {"output_index": self.index, "item_id": message.id, "content_index": 0}
            out.append(
                self.event("response.output_text.done", **common, text=part.text, logprobs=[])
            )
            out.append(self.event("response.content_part.done", **common, part=part))
            message.status = status
            out.append(
                self.event("response.output_item.done", output_index=self.index, item=message)
            )
            self.output.append(message)
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
    first: tuple[int, TextDelta],
    stream: AsyncGenerator[tuple[int, TextDelta], None],
) -> AsyncGenerator[bytes, None]:
    """The event stream (the first delta already read)."""
    out = _Events(head)
    reader = ToolReader(tools)
    try:
        yield out.event("response.created", response=head.response("in_progress", []))
        yield out.event("response.in_progress", response=head.response("in_progress", []))
        _, delta = first
        usage: Usage | None = None
        reason = None
        while True:
            final = delta.finish_reason is not None
            for tool_event in reader.read(delta.text, final):
                if isinstance(tool_event, ContentDelta):
                    chunks = out.text(tool_event.text)
                elif isinstance(tool_event, CallStart):
                    chunks = out.call_start(tool_event)
                else:
                    chunks = out.arguments(tool_event.text)
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
        if not out.output and out.message is None and out.call is None:
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
