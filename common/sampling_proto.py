"""SamplingParams <-> folio.v1.SamplingParams, both ways, for every service that speaks the
contract (engine service, gateway). Proto field names equal the library's, so the mapping is by
name; an unset `optional` field takes the library default. Pure translation, torch-free: it
never validates (SamplingParams.validate does) and never imports the engine runtime.
"""

from __future__ import annotations

from typing import Any

from common.grpc_stubs.folio.v1 import common_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from common.sampling_params import SamplingParams, StructuredOutput


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams()
    for field in message.DESCRIPTOR.fields:
        value = getattr(params, field.name)
        if value is None:
            continue  # unset `optional`: the engine's default, which is the library's
        if _is_map(field):
            getattr(message, field.name).update(value)
        elif field.name == "structured_output":
            message.structured_output.CopyFrom(structured_output_to_proto(value))
        elif field.name == "bad_words_token_ids":
            message.bad_words_token_ids.extend(
                common_pb2.TokenIds(token_ids=word) for word in value
            )
        elif field.is_repeated:
            getattr(message, field.name).extend(value)
        else:
            setattr(message, field.name, value)
    return message


def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    kwargs: dict[str, Any] = {}
    fields: Message = message  # read by field name, as a plain protobuf message
    for field in message.DESCRIPTOR.fields:
        if field.has_presence and not fields.HasField(field.name):
            continue  # unset: the library's default
        value = getattr(message, field.name)
        if _is_map(field):
            value = dict(value) or None
        elif field.name == "structured_output":
            value = structured_output_from_proto(value)
        elif field.name == "bad_words_token_ids":
            value = [list(word.token_ids) for word in value]
        elif field.name == "allowed_token_ids":
            value = list(value) or None  # empty on the wire: every token
        elif field.is_repeated:
            value = list(value)
        kwargs[field.name] = value
    return SamplingParams(**kwargs)


def structured_output_to_proto(constraint: StructuredOutput) -> common_pb2.StructuredOutput:
    message = common_pb2.StructuredOutput()
    for kind in ("json", "regex", "grammar"):
        if getattr(constraint, kind) is not None:
            setattr(message, kind, getattr(constraint, kind))
    if constraint.choice is not None:
        message.choice.choices.extend(constraint.choice)
    if constraint.json_object:
        message.json_object = True
    if constraint.source:
        message.source = constraint.source
    return message


def structured_output_from_proto(message: common_pb2.StructuredOutput) -> StructuredOutput:
    # No kind set gives an empty constraint, which SamplingParams.validate refuses by name.
    kind = message.WhichOneof("kind")
    source = message.source or None
    if kind is None:
        return StructuredOutput(source=source)
    value = getattr(message, kind)
    kwargs: dict[str, Any] = {kind: tuple(value.choices) if kind == "choice" else value}
    return StructuredOutput(source=source, **kwargs)
