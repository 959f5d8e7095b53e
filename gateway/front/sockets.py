"""The gateway's listening sockets: the HTTP one, made so that its connections get TCP_NODELAY,
and the reservation of a port that several gateway workers listen on with SO_REUSEPORT.
Plain sockets only: nothing here serves.
"""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on (host, port), made so that its connections get TCP_NODELAY.

    asyncio turns Nagle's algorithm off only for sockets whose protocol is IPPROTO_TCP, and a
    socket made without naming it (socket.create_server) reports protocol 0, as do the
    connections it accepts. With Nagle on, an SSE event written right after the response
    headers waited for the client's delayed ACK: 40 ms added to every streamed time to first
    token on a kept-alive connection.
    """
    sock = _bound_tcp_socket(host, port, socket.SO_REUSEADDR)
    try:
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound SO_REUSEPORT socket that never listens: it holds (host, port) for listeners
    that set SO_REUSEPORT too, and refuses everyone else; port 0 picks a free one."""
    return _bound_tcp_socket(host, port, socket.SO_REUSEPORT)


def _bound_tcp_socket(host: str, port: int, reuse_option: int) -> socket.socket:
    """A TCP socket (protocol named: IPPROTO_TCP) with `reuse_option` set, bound to (host,
    port)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, reuse_option, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
