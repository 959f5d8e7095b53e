"""Server-sent events framing: `data: <JSON>` events and `data: [DONE]` (completions), events
named by their type (the Responses and Messages APIs).

Framing only. The response closes its event iterator however it ends (done, failed, client
gone), so the iterator's cleanup (aborting engine requests) runs at once rather than whenever
the garbage collector gets to it. It never decides what the events say.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.json_lines import one_line

DONE = b"data: [DONE]\n\n"


def event(body: BaseModel) -> bytes:
    return b"data: " + one_line(body.model_dump_json().encode()) + b"\n\n"


def named_event(name: str, body: BaseModel) -> bytes:
    return f"event: {name}\ndata: ".encode() + one_line(body.model_dump_json().encode()) + b"\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None]) -> None:
        # no-cache / no buffering: proxies must pass each event on as it comes.
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        # Starlette types body_iterator as any iterable: keep the generator, to close it.
        self._events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
