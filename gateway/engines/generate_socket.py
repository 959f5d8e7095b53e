"""The gateway's end of an engine's Generate socket (services/engine/generate_socket.py): the
Generate stream's messages as length-prefixed frames on a TCP connection the event loop reads
itself, with none of gRPC's thread hand-offs per message.

Transport only: the caller (gateway/engines/clients.py's GenerateStream) decides when to use it
and what an end means.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from common.errors import status_code
from common.framing import HEADER_BYTES, FrameError, frame, payload_length
from gateway import wire

# How long connecting and the engine's answer to the open may take.
OPEN_SECONDS = 5.0


class GenerateSocketEnded(Exception):
    """The engine ended the connection with a status (GenerateSocketEnd)."""

    def __init__(self, end: wire.GenerateSocketEnd) -> None:
        super().__init__(end.message)
        self.code = status_code(end.code)
        self.message = end.message


class GenerateSocketConnection:
    """One open connection: GenerateRequest messages out, the engine's frames in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    def send(self, message: wire.GenerateMessage) -> None:
        self._writer.write(frame(message.SerializeToString()))

    async def responses(self) -> AsyncIterator[wire.GenerateResponse]:
        """Each step's message until the connection ends; GenerateSocketEnded when the engine
        ends it with a status, nothing more when it closes or breaks without one."""
        while (message := await self._next_frame()) is not None:
            if message.HasField("end"):
                raise GenerateSocketEnded(message.end)
            if message.HasField("response"):
                yield message.response

    async def _next_frame(self) -> wire.GenerateSocketFrame | None:
        try:
            length = payload_length(await self._reader.readexactly(HEADER_BYTES))
            return wire.generate_socket_frame(await self._reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    def close(self) -> None:
        self._writer.close()


async def open_generate_socket(
    host: str, port: int, authorization: str
) -> GenerateSocketConnection:
    """Connect and open (OSError or TimeoutError when the socket cannot be reached;
    GenerateSocketEnded when the engine refuses the open, e.g. UNAVAILABLE while warming)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), OPEN_SECONDS)
    connection = GenerateSocketConnection(reader, writer)
    try:
        writer.write(frame(wire.generate_socket_open(authorization)))
        answer = await asyncio.wait_for(connection._next_frame(), OPEN_SECONDS)
        if answer is None:
            raise ConnectionError("the engine closed its Generate socket's connection")
        if answer.HasField("end"):
            raise GenerateSocketEnded(answer.end)
        if not answer.HasField("ready"):
            raise FrameError("the engine's first frame is not GenerateSocketReady")
    except BaseException:
        connection.close()
        raise
    return connection
