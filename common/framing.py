"""Length-prefixed frames: the Generate socket's wire format (protos/folio/v1/engine.proto).

A frame is a 4-byte big-endian length and that many bytes of one protobuf message, bounded by
GRPC_MAX_MESSAGE_BYTES as gRPC's messages are. This module only cuts and joins bytes: it never
parses a message or touches a socket.
"""

from __future__ import annotations

import struct

from common.config import GRPC_MAX_MESSAGE_BYTES

_LENGTH = struct.Struct(">I")
# The bytes of a frame's length, before its payload.
HEADER_BYTES = _LENGTH.size


class FrameError(ValueError):
    """The peer sent something that is not a frame Folio accepts."""


def frame(payload: bytes) -> bytes:
    """`payload` with its length in front."""
    if len(payload) > GRPC_MAX_MESSAGE_BYTES:
        raise FrameError(
            f"a {len(payload)}-byte message is over the {GRPC_MAX_MESSAGE_BYTES}-byte limit"
        )
    return _LENGTH.pack(len(payload)) + payload


def payload_length(header: bytes | bytearray, offset: int = 0) -> int:
    """The payload length a frame's header at `offset` gives; FrameError over the limit."""
    (length,) = _LENGTH.unpack_from(header, offset)
    if length > GRPC_MAX_MESSAGE_BYTES:
        raise FrameError(
            f"a frame of {length} bytes is over the {GRPC_MAX_MESSAGE_BYTES}-byte limit"
        )
    return int(length)


class FrameReader:
    """Bytes in as they arrive, whole frames' payloads out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads `data` completes, in order; FrameError for a length over the limit (the
        connection is then beyond repair)."""
        self._buffer += data
        payloads: list[bytes] = []
        start = 0
        while len(self._buffer) - start >= HEADER_BYTES:
            length = payload_length(self._buffer, start)
            end = start + HEADER_BYTES + length
            if end > len(self._buffer):
                break
            payloads.append(bytes(self._buffer[start + HEADER_BYTES : end]))
            start = end
        del self._buffer[:start]
        return payloads

    @property
    def partial(self) -> bool:
        """Whether bytes of an unfinished frame are waiting."""
        return bool(self._buffer)
