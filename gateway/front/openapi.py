"""The gateway's OpenAPI 3.1 document, built from the route table and the pydantic shapes of
gateway/openai/protocol.py.

Document building only: it never routes or answers a request.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.openai.protocol import ErrorResponse, RequestBody

# The gateway's error statuses as the OpenAPI document describes them; each answer carries
# its route's error body (OpenAI's, or Anthropic's on the Messages API).
ERROR_STATUSES: dict[int, str] = {
    400: "Invalid request; the error names the offending field",
    401: "No valid API key came with the request",
    404: "The model, file or batch named does not exist (for the caller's API key)",
    413: "The body is over the gateway's size limit",
    415: "The body is not sent as application/json",
    429: "The engine's queue is full or the caller is over a rate limit; retry later",
    500: "Internal error",
    503: "The engine or the tokenizer is unavailable, or the gateway is draining; retry after "
    "the Retry-After header's seconds",
    504: "The request ran out of time",
}


JsonObject = dict[str, Any]
SchemaMode = Literal["validation", "serialization"]


def _mode(model: type[BaseModel]) -> SchemaMode:
    return "validation" if issubclass(model, RequestBody) else "serialization"


def _chunk_event(chunk: JsonObject, error: JsonObject) -> JsonObject:
    """An event of a completions stream: a chunk, an error body, or [DONE] last."""
    return {
        "description": "With stream=true, one event per delta: its data is a chunk, or an error "
        "body when the stream fails midway; the last event's data is [DONE].",
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [chunk, error]},
                    },
                ]
            }
        },
    }


def _typed_event(event: JsonObject) -> JsonObject:
    """An event of a Responses stream: named by its type, with the event as its data (a
    failure midway is an event of type error); no [DONE]."""
    return {
        "description": "With stream=true, the documented sequence of events, each named by its "
        "type and numbered by its sequence_number; a failure midway is an event of type error.",
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": event,
            },
        },
    }


def _parameters(path: str, query: type[BaseModel] | None) -> list[JsonObject]:
    """The path's {parameters}, then the query's fields (a query has no null: an optional
    field is one left out)."""
    parameters: list[JsonObject] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{(\w+)(?::\w+)?}", path)
    ]
    if query is not None:
        schema = query.model_json_schema()
        for name, field in schema["properties"].items():
            alternatives = [a for a in field.pop("anyOf", []) if a.get("type") != "null"]
            if len(alternatives) == 1:
                field.update(alternatives[0])
            parameters.append(
                {
                    "name": name,
                    "in": "query",
                    "required": name in schema.get("required", []),
                    "schema": field,
                }
            )
    return parameters


def openapi_document(endpoints: list[Any], title: str, version: str) -> JsonObject:
    """OpenAPI 3.1 for `endpoints` (objects with path, method, summary, request,
    request_media_type, query, response, stream, stream_done, media_type, answers, errors and
    error_model attributes); schemas come from their pydantic models.
    Every status an operation can answer is listed (no `default`), so a client and a fuzzer
    can tell an undocumented one."""
    models: set[type[BaseModel]] = {
        m for e in endpoints for m in (e.request, e.response, e.stream) if m is not None
    }
    models |= {e.error_model for e in endpoints}
    keyed = [(m, _mode(m)) for m in sorted(models, key=lambda m: m.__name__)]
    refs, defs = models_json_schema(keyed, ref_template="#/components/schemas/{model}")
    for e in endpoints:  # parse_request refuses unknown top-level fields
        if e.request is not None:
            defs["$defs"][e.request.__name__]["additionalProperties"] = False

    def ref(model: type[BaseModel]) -> JsonObject:
        return dict(refs[(model, _mode(model))])

    def error(status: int, model: type[BaseModel]) -> JsonObject:
        return {
            "description": ERROR_STATUSES[status],
            "content": {"application/json": {"schema": ref(model)}},
        }

    paths: dict[str, JsonObject] = {}
    for e in endpoints:
        content: dict[str, Any] = {}
        if e.response is not None:
            content[e.media_type] = {"schema": ref(e.response)}
        if e.stream is not None:
            # Before OpenAPI 3.2, the schema of an event stream describes one event.
            content["text/event-stream"] = {
                "schema": _chunk_event(ref(e.stream), ref(ErrorResponse))
                if e.stream_done
                else _typed_event(ref(e.stream))
            }
        responses = {
            str(status): {"description": HTTPStatus(status).phrase, "content": content}
            for status in e.answers
        }
        responses.update({str(status): error(status, e.error_model) for status in sorted(e.errors)})
        operation: dict[str, Any] = {"summary": e.summary, "responses": responses}
        parameters = _parameters(e.path, e.query)
        if parameters:
            operation["parameters"] = parameters
        if e.request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {e.request_media_type: {"schema": ref(e.request)}},
            }
        # Starlette's converters ({name:path}) are not OpenAPI's: the parameter's name alone.
        paths.setdefault(re.sub(r"{(\w+):\w+}", r"{\1}", e.path), {})[e.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }
