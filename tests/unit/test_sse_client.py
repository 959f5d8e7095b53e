"""bench.sse_client against a real HTTP server on loopback that writes its responses in awkward
pieces: headers and chunks cut mid-line, CRLF line ends, `data:` with and without a space, a
status other than 200, and connections kept alive or closed."""

from __future__ import annotations

import asyncio

import pytest

from bench.sse_client import HTTPStatusError, SSEClient

EVENTS = [b'data: {"n": 1}\r\n\r\n', b'data:{"n": 2}\n\n', b": a comment\n\n", b"data: [DONE]\n\n"]


class PieceServer:
    """Answers each request on a connection with `status` and EVENTS in chunked encoding, the
    bytes written a few at a time; counts connections and requests."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                close = b"connection: close" in head.lower()
                if self.status == 200:
                    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"
                    reason, kind = b"OK", b"text/event-stream"
                    framing = b"Transfer-Encoding: chunked\r\n"
                else:
                    body, reason, kind = b"no such model", b"Bad Request", b"text/plain"
                    framing = b"Content-Length: %d\r\n" % len(body)
                response = (
                    b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s\r\n"
                    % (self.status, reason, kind, framing)
                    + body
                )
                for start in range(0, len(response), 7):  # cut anywhere: mid-line, mid-CRLF
                    writer.write(response[start : start + 7])
                    await writer.drain()
                    await asyncio.sleep(0)
                if close:
                    break
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


async def _serve(server: PieceServer, run) -> None:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        await run(f"http://127.0.0.1:{port}")


async def _lines(client: SSEClient) -> list[bytes]:
    return [line async for line in client.data_lines("/v1/completions", {"prompt": "hi"})]


@pytest.mark.parametrize("keep_alive", [True, False])
def test_data_lines_arrive_whole_whatever_the_pieces(keep_alive):
    server = PieceServer()

    async def run(url: str) -> None:
        client = SSEClient(url, keep_alive=keep_alive)
        try:
            for _ in range(3):
                assert await _lines(client) == [b'{"n": 1}', b'{"n": 2}', b"[DONE]"]
        finally:
            await client.close()

    asyncio.run(_serve(server, run))
    assert len(server.requests) == 3
    assert server.requests[0].endswith(b'{"prompt": "hi"}')
    # Kept alive: one connection serves every request; otherwise one each.
    assert server.connections == (1 if keep_alive else 3)


def test_a_status_other_than_200_raises_with_the_body():
    server = PieceServer(status=400)

    async def run(url: str) -> None:
        client = SSEClient(url)
        with pytest.raises(HTTPStatusError, match="400: no such model"):
            await _lines(client)
        await client.close()

    asyncio.run(_serve(server, run))


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="http:// or https://"):
        SSEClient("grpc://127.0.0.1:50051")
