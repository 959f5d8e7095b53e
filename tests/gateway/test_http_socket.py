"""The gateway's HTTP listening socket: its connections must have Nagle's algorithm off.

With Nagle on, an SSE event written right after the response headers waits for the client's
delayed ACK (40 ms on Linux) on a kept-alive connection, which once doubled the streamed time to
first token.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.front.server import listening_socket


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_have_nodelay(host):
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")

    async def accept_one() -> int:
        sock = listening_socket(host, 0)
        port = sock.getsockname()[1]
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            server_side = writer.get_extra_info("socket")
            accepted.set_result(server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(host, port)
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
        return nodelay

    try:
        assert asyncio.run(accept_one()) != 0
    except OSError as exc:  # ::1 may be missing even where IPv6 exists
        if host == "::1":
            pytest.skip(f"no IPv6 loopback: {exc}")
        raise


def test_a_busy_port_raises():
    first = listening_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
