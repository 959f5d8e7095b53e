"""Why a request ended: the one definition every process shares, and its protobuf enum.

The engine sets it, the engine service puts it on the wire, the gateway reads it back and
writes it into OpenAI responses (whose finish_reason strings are these values). Plain data
and translation only; it never decides when a request ends.
"""

from __future__ import annotations

import enum

from common.grpc_stubs.folio.v1 import common_pb2


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token, a stop string, or a completed grammar
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    DEADLINE = "deadline"  # past its total deadline (slo_total_ms), ended by the engine


_TO_PROTO: dict[FinishReason, common_pb2.FinishReason.ValueType] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.DEADLINE: common_pb2.FINISH_REASON_DEADLINE,
}
_FROM_PROTO = {value: reason for reason, value in _TO_PROTO.items()}


def finish_reason_to_proto(reason: str) -> common_pb2.FinishReason.ValueType:
    """folio.v1.FinishReason for a reason (a FinishReason or its string)."""
    return _TO_PROTO[FinishReason(reason)]


def finish_reason_from_proto(value: int) -> FinishReason:
    """The reason a folio.v1.FinishReason stands for; ValueError for UNSPECIFIED or unknown."""
    try:
        return _FROM_PROTO[common_pb2.FinishReason.ValueType(value)]
    except KeyError:
        raise ValueError(
            f"finish_reason {value} is not one of stop, length, abort, deadline"
        ) from None
