"""The lines of a batch job: an input file read into lines (each malformed one answered at once
with its own error), and one line run through the same library functions the HTTP route of its
url calls (gateway/openai/completions.py, embeddings.py and responses/, gateway/anthropic/,
front/serving.py), answered as a line of the output file (200) or of the error file (any other
status, in OpenAI's error body).

A line runs in the engine's batch lane (priority BATCH_PRIORITY, whatever it asks: it gives way
to every interactive request), is never streamed and is charged to no rate limit (the job's
concurrency bounds it). Never touches the database or an HTTP connection.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from common.config import GatewayConfig
from common.errors import QueueFullError, UnavailableError
from common.sampling_params import BATCH_PRIORITY
from gateway.anthropic import events as message_events
from gateway.anthropic import protocol as aapi
from gateway.anthropic import translate as anthropic
from gateway.batch.protocol import InputLine, LineError, LineResponse, OutputLine
from gateway.batch.store import Line, ReadLine, new_id
from gateway.engines.pinning import set_pin_owner
from gateway.front.http_errors import error_body, log_failure
from gateway.front.serving import serve
from gateway.limits.deadlines import set_deadline
from gateway.limits.rate_limit import RateLimiter
from gateway.openai import completions, embeddings
from gateway.openai import embeddings_protocol as eapi
from gateway.openai import protocol as api
from gateway.openai.responses import events as response_events
from gateway.openai.responses import protocol as rapi
from gateway.openai.responses import translate as responses
from gateway.pipeline.generation import Gateway, mark_in_flight
from gateway.pipeline.text import TextDelta, TextRequest


@dataclass
class LineContext:
    """What running a line needs of the gateway."""

    gateway: Gateway
    config: GatewayConfig
    # No limits: a job's lines are bounded by its concurrency, not by its owner's rates.
    limiter: RateLimiter = field(default_factory=lambda: RateLimiter(None, None))


# A route's answer to a line's body: the response body, as JSON-ready data.
Route = Callable[[LineContext, str, bytes], Awaitable[dict[str, Any]]]
# A plan's deltas, as it runs: (choice, delta).
Deltas = AsyncGenerator[tuple[int, TextDelta], None]


def _batch_body(body: api.SamplingFields) -> None:
    if body.stream:
        raise api.InvalidParameter("stream is not supported in a batch line", "stream")
    body.priority = BATCH_PRIORITY


def _serve(context: LineContext, caller: str) -> embeddings.Serve:
    """How a line's requests run: front/serving.py's serve, unlimited, bounded by the
    request timeout from now."""
    arrival = time.monotonic()
    timeout = context.config.request_timeout

    def run(
        requests: Sequence[TextRequest], request_id: str
    ) -> AsyncGenerator[tuple[int, TextDelta], None]:
        return serve(
            context.gateway,
            context.limiter,
            caller,
            requests,
            request_id,
            arrival,
            arrival + timeout,
            timeout,
        )

    return run


async def _served(
    context: LineContext,
    caller: str,
    plan: completions.Plan,
    answer: Callable[[Deltas], Awaitable[BaseModel]] | None = None,
) -> dict[str, Any]:
    """The plan run to its end; `answer` makes the response of its deltas (a completion's or
    a chat completion's by default)."""
    stream = plan.outputs(_serve(context, caller)(plan.requests, plan.id))
    async with contextlib.aclosing(stream):
        if answer is None:
            response: BaseModel = await completions.respond(plan, stream)
        else:
            response = await answer(stream)
    return response.model_dump(mode="json")


async def _planned_chat(context: LineContext, body: api.ChatCompletionRequest) -> completions.Plan:
    _batch_body(body)
    config = context.config
    return await completions.plan_chat(
        context.gateway, body, config.tool_call_parser, config.reasoning_parser
    )


async def _chat(context: LineContext, caller: str, raw: bytes) -> dict[str, Any]:
    body = api.parse_request(api.ChatCompletionRequest, raw)
    return await _served(context, caller, await _planned_chat(context, body))


async def _response(context: LineContext, caller: str, raw: bytes) -> dict[str, Any]:
    """A Responses API line, run on the chat path as the HTTP route runs it."""
    body = api.parse_request(rapi.ResponsesRequest, raw)
    plan = await _planned_chat(context, responses.chat_request(body))
    head = responses.ResponseHead.of(body, plan.model)
    return await _served(
        context,
        caller,
        plan,
        lambda stream: response_events.respond(head, plan.tools, plan.reasoning, stream),
    )


async def _message(context: LineContext, caller: str, raw: bytes) -> dict[str, Any]:
    """An Anthropic Messages line (a message batch's request), run on the chat path as the
    HTTP route runs it, answered with the whole Message."""
    body = api.parse_request(aapi.MessagesRequest, raw)
    plan = await _planned_chat(context, anthropic.chat_request(body))
    head = anthropic.MessageHead.of(
        plan.model, len(plan.requests[0].prompt_ids), anthropic.shows_thinking(body)
    )
    return await _served(
        context,
        caller,
        plan,
        lambda stream: message_events.respond(head, plan.tools, plan.reasoning, stream),
    )


async def _completion(context: LineContext, caller: str, raw: bytes) -> dict[str, Any]:
    body = api.parse_request(api.CompletionRequest, raw)
    _batch_body(body)
    plan = await completions.plan_completion(context.gateway, body)
    return await _served(context, caller, plan)


async def _embedding(context: LineContext, caller: str, raw: bytes) -> dict[str, Any]:
    body = api.parse_request(eapi.EmbeddingRequest, raw)
    return await embeddings.create_embeddings(
        context.gateway, body, _serve(context, caller), BATCH_PRIORITY
    )


# The urls a line may name (protocol.BatchEndpoint), and what serves each.
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completion,
    "/v1/embeddings": _embedding,
    "/v1/responses": _response,
    "/v1/messages": _message,
}


def _error_line(custom_id: str | None, code: str, message: str) -> OutputLine:
    return OutputLine(
        id=new_id("batch_req_"), custom_id=custom_id, error=LineError(code=code, message=message)
    )


def read_input(content: bytes) -> list[ReadLine]:
    """The input file's lines (blank ones skipped), numbered from 1 as in the file: each to
    run, or answered with an error if it is not a request this server runs (not JSON, not
    {custom_id, method POST, url, body}, a url it does not serve, a custom_id seen before)."""
    lines: list[ReadLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = InputLine.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:
            custom_id = _custom_id(raw)
            lines.append(ReadLine(number, custom_id, result=_malformed(number, custom_id, exc)))
            continue
        if line.url not in ROUTES:
            served = ", ".join(ROUTES)
            code = "invalid_url"
            message = f"line {number}: url {line.url} is not served in a batch here ({served})"
        elif line.custom_id in seen:
            code = "duplicate_custom_id"
            message = f"line {number}: custom_id {line.custom_id!r} is used by an earlier line"
        else:
            seen.add(line.custom_id)
            lines.append(ReadLine(number, line.custom_id, line.url, json.dumps(line.body)))
            continue
        error = _error_line(line.custom_id, code, message)
        lines.append(ReadLine(number, line.custom_id, result=error))
    return lines


def _custom_id(raw: bytes) -> str | None:
    """A malformed line's custom_id, if it has a readable one."""
    with contextlib.suppress(ValueError):
        value = json.loads(raw)
        if isinstance(value, dict):
            custom_id = value.get("custom_id")
            return custom_id if isinstance(custom_id, str) else None
    return None


def _malformed(number: int, custom_id: str | None, exc: Exception) -> OutputLine:
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the line"
        message = f"line {number}: {where}: {error['msg']}"
        return _error_line(custom_id, "invalid_request", message)
    return _error_line(None, "invalid_json_line", f"line {number} is not valid JSON: {exc}")


async def answer(context: LineContext, owner: str, line: Line) -> tuple[bool, OutputLine]:
    """Run a line; whether it was answered 200, and its output or error line. A passing
    failure (the engine unavailable or its queue full) is raised instead, for a later try."""
    request_id = new_id("req_")
    set_deadline(time.monotonic() + context.config.request_timeout)
    set_pin_owner(owner, context.config.max_pinned_gib_per_key)  # its pins are its key's
    # Started by the runner, which stops starting lines when the gateway drains: the line is in
    # flight, and a drain beginning while it runs must let it finish, not refuse it half-way
    # (it would be counted as one more attempt and run again after the restart).
    mark_in_flight()
    try:
        body = await ROUTES[line.url](context, owner, line.body.encode())
    except (UnavailableError, QueueFullError):
        raise
    except Exception as exc:
        log_failure(exc)
        return False, _response_line(line, request_id, exc)
    response = LineResponse(status_code=200, request_id=request_id, body=body)
    return True, OutputLine(id=new_id("batch_req_"), custom_id=line.custom_id, response=response)


def _response_line(line: Line, request_id: str, exc: Exception) -> OutputLine:
    status, error = error_body(exc)
    response = LineResponse(
        status_code=status, request_id=request_id, body=error.model_dump(mode="json")
    )
    return OutputLine(id=new_id("batch_req_"), custom_id=line.custom_id, response=response)
