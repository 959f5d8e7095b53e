"""A lean HTTP/1.1 client for the benchmarks' streamed requests: POST a JSON body, read the
server-sent events' data lines back as they arrive.

The benchmarks run their clients on the machine the served stack runs on, so every millisecond
of CPU a client spends per streamed token is taken from the engine's cores: httpx (HTTP parsed
in Python, on anyio) spent 0.39 ms a token, about a twentieth of a one-stream decode step on a
2-core machine, and the served / in-process ratio measured the client as much as the server.
Here the response is parsed by httptools (the C parser uvicorn serves with) over asyncio's
streams, on connections kept alive per client. Bench-only: the services never import it, and
it speaks only what the benchmarks send (a POST with a JSON body, over http or https).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

READ_BYTES = 65536


@dataclass
class _Response:
    """httptools' callbacks: the body as it comes (chunked encoding undone), whether the message
    is complete, and whether its connection may serve another (the parser says so only while
    its callbacks run)."""

    parser: httptools.HttpResponseParser | None = None
    body: bytearray = field(default_factory=bytearray)
    headers_done: bool = False
    complete: bool = False
    keep_alive: bool = False

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()


class HTTPStatusError(RuntimeError):
    """A response whose status is not 200, with the body the server sent."""


class SSEClient:
    """POSTs to one server (`base_url`: scheme, host and port; http or https). `keep_alive`:
    whether a connection serves later requests once its response is read (llama-server closes
    idle kept-alive connections after seconds, and a request sent on one just closed fails
    before the server sees it: a peer gets a new connection per request)."""

    def __init__(self, base_url: str, keep_alive: bool = True) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r}: an http:// or https:// URL with a host")
        self._host = parts.hostname
        self._https = parts.scheme == "https"
        self._port = parts.port or (443 if self._https else 80)
        self._netloc = parts.netloc
        self._keep_alive = keep_alive
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def data_lines(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """POST `body` as JSON to `path` and yield the payload of each `data:` line of the
        event stream as it arrives; raises HTTPStatusError on a status other than 200."""
        payload = json.dumps(body).encode()
        connection = "keep-alive" if self._keep_alive else "close"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self._netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nConnection: {connection}\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        reader, writer = await self._connection()
        reusable = False
        try:
            writer.write(head + payload)
            response = _Response()
            parser = response.parser = httptools.HttpResponseParser(response)
            pending = bytearray()
            while not response.complete:
                data = await reader.read(READ_BYTES)
                if not data:
                    raise ConnectionError(f"{self._netloc} closed the connection mid-response")
                parser.feed_data(data)
                if not response.headers_done or parser.get_status_code() != 200:
                    continue
                pending += response.body
                response.body.clear()
                # Whole lines until the message is complete (its last may end without one).
                end = len(pending) if response.complete else pending.rfind(b"\n") + 1
                for line in bytes(pending[:end]).split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].strip()
                del pending[:end]
            status = parser.get_status_code()
            if status != 200:
                text = bytes(response.body).decode(errors="replace")
                raise HTTPStatusError(f"{status}: {text}")
            reusable = self._keep_alive and response.keep_alive
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        context = ssl.create_default_context() if self._https else None
        return await asyncio.open_connection(self._host, self._port, ssl=context, limit=2**20)

    async def close(self) -> None:
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()
