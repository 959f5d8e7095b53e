"""The HTTP gateway's routes (Starlette): OpenAI-compatible completions, Anthropic's Messages
API (gateway/anthropic/), models, vLLM-style
tokenize / detokenize, health, Prometheus metrics, what SMG discovers and polls (SGLang-style
server and model info, loads: gateway/front/smg.py), the Files and Batch APIs (gateway/batch/),
the OpenAPI document, and the web pages (the playground and the dashboard, gateway/front/pages.py)
with the dashboard's feed (gateway/front/dashboard.py).

Routes stay thin, module-level handlers: read the body, call completions.py / generation.py /
serving.py, write the answer; what they share (the Gateway, the config, the access checks) is
the app's AppContext. One table (ENDPOINTS, and WEBUI_ENDPOINTS unless --no-webui) both routes
requests and documents them, so /openapi.json cannot miss a route.
A client that disconnects cancels its handler, which aborts its engine requests; so does the
request timeout (504). Every route checks the caller's API key and request rate first
(gateway/limits/auth.py). This module holds no business logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from common.config import DASHBOARD_FEED_INTERVAL_SECONDS, MAX_REQUEST_BODY_BYTES, GatewayConfig
from gateway.anthropic import events as message_events
from gateway.anthropic import protocol as aapi
from gateway.anthropic import translate as anthropic
from gateway.anthropic.batches import MessageBatches
from gateway.batch import protocol as bapi
from gateway.batch.service import BatchService, parse_query
from gateway.engines.pinning import set_pin_owner
from gateway.front import dashboard, smg
from gateway.front.http_errors import error_body, error_headers, log_failure
from gateway.front.openapi import openapi_document
from gateway.front.pages import HEADERS, WebFile, load_web_files
from gateway.front.serving import serve
from gateway.front.sse import EventStreamResponse
from gateway.front.uploads import MULTIPART, MULTIPART_OVERHEAD_BYTES, parse_upload
from gateway.limits.auth import Access
from gateway.limits.deadlines import set_deadline
from gateway.limits.service_level import set_service_level
from gateway.messages import ChatPrompt, ChatTurn
from gateway.metrics import CONTENT_TYPE
from gateway.openai import completions, embeddings
from gateway.openai import embeddings_protocol as eapi
from gateway.openai import protocol as api
from gateway.openai.responses import events as response_events
from gateway.openai.responses import protocol as rapi
from gateway.openai.responses import translate
from gateway.pipeline.generation import Gateway
from gateway.pipeline.text import TextDelta, TextRequest
from gateway.pipeline.validation import check_token_ids

Handler = Callable[[Request], Awaitable[Response]]
SamplingRequestT = TypeVar("SamplingRequestT", bound=api.SamplingFields)
Deltas = AsyncGenerator[tuple[int, TextDelta], None]


class ModelResponse(Response):
    media_type = "application/json"

    def __init__(self, body: BaseModel, status_code: int = 200, exclude_none: bool = False) -> None:
        super().__init__(body.model_dump_json(exclude_none=exclude_none), status_code)


ErrorBody = Callable[[BaseException], tuple[int, BaseModel]]


def error_response(exc: BaseException, body_of: ErrorBody = error_body) -> Response:
    log_failure(exc)
    status, body = body_of(exc)
    response = ModelResponse(body, status)
    response.headers.update(error_headers(exc))
    return response


@dataclass
class Endpoint:
    path: str
    method: str
    summary: str
    handler: Handler | None = None
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    stream: type[BaseModel] | None = None  # the event shape, when it can stream
    stream_done: bool = True  # the stream ends with [DONE] (the Responses API's does not)
    media_type: str = "application/json"
    request_media_type: str = "application/json"
    query: type[BaseModel] | None = None  # the query parameters, as fields
    answers: tuple[int, ...] = (200,)  # the statuses that come with `response`
    errors: tuple[int, ...] = ()  # the statuses that come with the error body
    # The error body's shape (OpenAI's unless the route speaks another API) and its writer.
    error_model: type[BaseModel] = api.ErrorResponse
    error_body: ErrorBody = error_body


# The error statuses each kind of route can answer (openapi.ERROR_STATUSES says what they mean):
# any route checks the API key and the caller's rate, and may fail; routes that ask the engine
# or the tokenizer find them unavailable or run out of time; routes that read a body refuse it.
ANY_ROUTE_ERRORS = (401, 429, 500)
SERVICE_ERRORS = (*ANY_ROUTE_ERRORS, 503, 504)
BODY_ERRORS = (400, 404, 413, 415, *SERVICE_ERRORS)
# Sent by the anthropic client with every request: /v1/models then answers in Anthropic's shape.
ANTHROPIC_VERSION_HEADER = "anthropic-version"


async def read_body(request: Request, model: type[api.RequestT]) -> api.RequestT:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise api.UnsupportedMediaType(
            f"the body must be JSON sent as Content-Type: application/json, got {media_type!r}"
        )
    return api.parse_request(model, await read_limited(request))


async def read_limited(request: Request, limit: int = MAX_REQUEST_BODY_BYTES) -> bytes:
    """The body; RequestTooLarge as soon as it is known to be over `limit` bytes (by its
    Content-Length before reading, else while reading), so it is never buffered whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise api.RequestTooLarge(f"the body is {declared} bytes, over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise api.RequestTooLarge(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`, cancelling it if the client disconnects first (which aborts its requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if not watcher.done():
            raise  # we are being cancelled ourselves
        return Response(status_code=499)  # nobody is left to read it
    finally:
        watcher.cancel()


@dataclass
class AppContext:
    """What the handlers share, kept on the app (app.state.context)."""

    gateway: Gateway
    config: GatewayConfig
    access: Access
    batches: BatchService
    openapi: str  # the OpenAPI document, serialized once


def _context(request: Request) -> AppContext:
    context: AppContext = request.app.state.context
    return context


async def _completion(
    request: Request,
    model: type[SamplingRequestT],
    plan: Callable[[Gateway, SamplingRequestT], Awaitable[completions.Plan]],
) -> Response:
    arrival = time.monotonic()
    context = _context(request)
    body = await read_body(request, model)

    async def run() -> Response:
        planned = await plan(context.gateway, body)
        return await _answer(
            request,
            planned,
            arrival,
            body.stream,
            lambda stream: completions.respond(planned, stream),
            lambda first, stream: completions.events(planned, first, stream),
        )

    return await until_disconnect(request, run())


async def _answer(
    request: Request,
    planned: completions.Plan,
    arrival: float,
    stream_events: bool,
    whole: Callable[[Deltas], Awaitable[BaseModel]],
    events: Callable[[tuple[int, TextDelta], Deltas], AsyncGenerator[bytes, None]],
) -> Response:
    """Serve a planned request; answer the whole body, or stream its events."""
    context = _context(request)
    stream = planned.outputs(
        serve(
            context.gateway,
            context.access.limiter,
            request.state.caller,
            planned.requests,
            planned.id,
            arrival,
            request.state.deadline,
            context.config.request_timeout,
        )
    )
    if not stream_events:
        async with contextlib.aclosing(stream):
            return ModelResponse(await whole(stream))
    # The first delta before the headers: an engine that refuses the request (queue full,
    # unavailable) still gets its proper status code.
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()
        raise
    return EventStreamResponse(events(first, stream))


async def chat_completions(request: Request) -> Response:
    config = _context(request).config
    return await _completion(
        request,
        api.ChatCompletionRequest,
        lambda gateway, body: completions.plan_chat(
            gateway, body, config.tool_call_parser, config.reasoning_parser
        ),
    )


Answers = tuple[
    Callable[[Deltas], Awaitable[BaseModel]],
    Callable[[tuple[int, TextDelta], Deltas], AsyncGenerator[bytes, None]],
]


async def _via_chat(
    request: Request,
    model: type[api.RequestT],
    to_chat: Callable[[api.RequestT], api.ChatCompletionRequest],
    answers: Callable[[api.RequestT, completions.Plan], Answers],
) -> Response:
    """A request of another API served on the chat path: translated to a chat request, planned
    and run as one (streamed when the chat request is), answered in its own API's shapes
    (`answers`: the whole body and the event stream)."""
    arrival = time.monotonic()
    context = _context(request)
    body = await read_body(request, model)

    async def run() -> Response:
        chat = to_chat(body)
        planned = await completions.plan_chat(
            context.gateway, chat, context.config.tool_call_parser, context.config.reasoning_parser
        )
        whole, events = answers(body, planned)
        return await _answer(request, planned, arrival, chat.stream, whole, events)

    return await until_disconnect(request, run())


async def create_response(request: Request) -> Response:
    def answers(body: rapi.ResponsesRequest, planned: completions.Plan) -> Answers:
        head = translate.ResponseHead.of(body, planned.model)
        return (
            lambda stream: response_events.respond(head, planned.tools, planned.reasoning, stream),
            lambda first, stream: response_events.events(
                head, planned.tools, planned.reasoning, first, stream
            ),
        )

    return await _via_chat(request, rapi.ResponsesRequest, translate.chat_request, answers)


async def create_message(request: Request) -> Response:
    def answers(body: aapi.MessagesRequest, planned: completions.Plan) -> Answers:
        head = anthropic.MessageHead.of(
            planned.model, len(planned.requests[0].prompt_ids), anthropic.shows_thinking(body)
        )
        return (
            lambda stream: message_events.respond(head, planned.tools, planned.reasoning, stream),
            lambda first, stream: message_events.events(
                head, planned.tools, planned.reasoning, first, stream
            ),
        )

    return await _via_chat(request, aapi.MessagesRequest, anthropic.chat_request, answers)


async def count_message_tokens(request: Request) -> Response:
    context = _context(request)
    body = await read_body(request, aapi.CountTokensRequest)
    # The prompt the same request would run, whatever it asks to generate: a prompt too long to
    # leave room for an answer still has a count.
    _info, _chat, prompt = await completions.chat_prompt(
        context.gateway, anthropic.chat_request(body), context.config.tool_call_parser
    )
    return ModelResponse(aapi.TokenCount(input_tokens=len(prompt.token_ids)))


async def text_completions(request: Request) -> Response:
    return await _completion(request, api.CompletionRequest, completions.plan_completion)


async def _pooling(
    request: Request,
    model: type[api.RequestT],
    plan: Callable[[Gateway, api.RequestT], Awaitable[embeddings.PoolingPlan]],
) -> Response:
    """An embedding, score or rerank request: planned, its inputs embedded, answered whole."""
    arrival = time.monotonic()
    context = _context(request)
    body = await read_body(request, model)

    def run(requests: Sequence[TextRequest], request_id: str) -> Deltas:
        return serve(
            context.gateway,
            context.access.limiter,
            request.state.caller,
            requests,
            request_id,
            arrival,
            request.state.deadline,
            context.config.request_timeout,
        )

    async def answer() -> Response:
        planned = await plan(context.gateway, body)
        return ModelResponse(await embeddings.answer(planned, run), exclude_none=True)

    return await until_disconnect(request, answer())


async def create_embeddings(request: Request) -> Response:
    return await _pooling(request, eapi.EmbeddingRequest, embeddings.plan_embeddings)


async def score(request: Request) -> Response:
    return await _pooling(request, eapi.ScoreRequest, embeddings.plan_score)


async def rerank(request: Request) -> Response:
    return await _pooling(request, eapi.RerankRequest, embeddings.plan_rerank)


async def _model_cards(gateway: Gateway) -> list[api.ModelCard]:
    """The served model under each of its names, then its LoRA adapters."""
    info = await gateway.check_model(None)
    base = api.ModelCard(
        id=info.name, created=info.created, root=info.path, max_model_len=info.max_model_len
    )
    aliases = [base.model_copy(update=dict(id=name)) for name in info.names[1:]]
    adapters = [
        base.model_copy(update=dict(id=name, root=name, parent=info.name))
        for name in await gateway.engine.lora_adapters()
    ]
    return [base, *aliases, *adapters]


def _asks_anthropic(request: Request) -> bool:
    """The anthropic client sends anthropic-version with every request; OpenAI's never do."""
    return ANTHROPIC_VERSION_HEADER in request.headers


async def models(request: Request) -> Response:
    cards = await _model_cards(_context(request).gateway)
    if _asks_anthropic(request):
        infos = [anthropic.model_info(card) for card in cards]
        return ModelResponse(
            aapi.ModelList(
                data=infos,
                first_id=infos[0].id if infos else None,
                last_id=infos[-1].id if infos else None,
            )
        )
    return ModelResponse(api.ModelList(data=cards))


async def model(request: Request) -> Response:
    """OpenAI's retrieve (Anthropic's, for the anthropic client): one of /v1/models' entries
    by its id."""
    gateway = _context(request).gateway
    name = request.path_params["model"]
    cards = await _model_cards(gateway)
    card = next((card for card in cards if card.id == name), None)
    if card is None:
        served = ", ".join(repr(card.id) for card in cards)
        raise api.ModelNotFound(
            f"the model {name!r} does not exist; this server serves {served}", "model"
        )
    return ModelResponse(anthropic.model_info(card) if _asks_anthropic(request) else card)


async def load_lora_adapter(request: Request) -> Response:
    body = await read_body(request, api.LoadLoraAdapterRequest)
    gateway = _context(request).gateway
    if body.lora_name == (await gateway.check_model(None)).name:
        raise api.InvalidParameter("lora_name must differ from the base model's name", "lora_name")
    await gateway.engine.load_lora_adapter(body.lora_name, body.lora_path)
    return ModelResponse(api.LoraAdapterStatus(lora_name=body.lora_name, status="loaded"))


async def unload_lora_adapter(request: Request) -> Response:
    body = await read_body(request, api.UnloadLoraAdapterRequest)
    await _context(request).gateway.engine.unload_lora_adapter(body.lora_name)
    return ModelResponse(api.LoraAdapterStatus(lora_name=body.lora_name, status="unloaded"))


async def tokenize(request: Request) -> Response:
    gateway = _context(request).gateway
    body = await read_body(request, api.TokenizeRequest)
    info = await gateway.check_model(body.model)
    if body.messages is not None and body.prompt is None:
        messages = [ChatTurn(role=m.role, content=m.text, name=m.name) for m in body.messages]
        chat = ChatPrompt(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
        result = await gateway.tokenize_chat(chat, body.return_token_strs)
    elif body.prompt is not None and body.messages is None:
        result = await gateway.tokenize_text(
            body.prompt, body.add_special_tokens, body.return_token_strs
        )
    else:
        raise api.InvalidParameter("set exactly one of prompt and messages", "prompt")
    return ModelResponse(
        api.TokenizeResponse(
            count=len(result.token_ids),
            max_model_len=info.max_model_len,
            tokens=list(result.token_ids),
            token_strs=list(result.token_strs) if body.return_token_strs else None,
        )
    )


async def detokenize(request: Request) -> Response:
    gateway = _context(request).gateway
    body = await read_body(request, api.DetokenizeRequest)
    check_token_ids(await gateway.check_model(body.model), body.tokens, "tokens")
    # As vLLM: the exact text of the ids, special tokens included, so tokenize round-trips.
    text = await gateway.tokenizer.detokenize(body.tokens, skip_special_tokens=False)
    return ModelResponse(api.DetokenizeResponse(prompt=text))


async def health(request: Request) -> Response:
    gateway = _context(request).gateway
    engine, tokenizer = await asyncio.gather(gateway.engine.serving(), gateway.text_ready())
    down = [name for name, up in (("engine", engine), ("tokenizer", tokenizer)) if not up]
    if gateway.draining:
        down.append("gateway (draining)")
    if down:
        return ModelResponse(
            api.HealthResponse(status="unavailable", detail="not serving: " + ", ".join(down)),
            503,
        )
    return ModelResponse(api.HealthResponse(status="ok"), exclude_none=True)


async def metrics(request: Request) -> Response:
    gateway = _context(request).gateway
    return Response(gateway.metrics.render(await gateway.engine_stats()), media_type=CONTENT_TYPE)


async def server_info(request: Request) -> Response:
    return ModelResponse(await smg.server_info(_context(request).gateway), exclude_none=True)


async def model_info(request: Request) -> Response:
    return ModelResponse(await smg.model_info(_context(request).gateway))


async def loads(request: Request) -> Response:
    return ModelResponse(await smg.loads(_context(request).gateway))


async def openapi(request: Request) -> Response:
    return Response(_context(request).openapi, media_type="application/json")


async def create_file(request: Request) -> Response:
    context = _context(request)
    limit = context.batches.max_upload_bytes
    # The body holds the file and its multipart framing: the file's own limit is checked
    # once it is read.
    body = await read_limited(request, limit + MULTIPART_OVERHEAD_BYTES)
    filename, upload = await parse_upload(request.headers, body, limit)
    owner = context.access.owner(request)
    return ModelResponse(await context.batches.create_file(owner, filename, upload))


async def file_content(request: Request) -> Response:
    context = _context(request)
    file_id = request.path_params["file_id"]
    content = await context.batches.file_content(context.access.owner(request), file_id)
    return Response(content, media_type="application/octet-stream")


async def create_batch(request: Request) -> Response:
    context = _context(request)
    body = await read_body(request, bapi.BatchCreateRequest)
    return ModelResponse(await context.batches.create_batch(context.access.owner(request), body))


async def create_message_batch(request: Request) -> Response:
    context = _context(request)
    body = await read_body(request, aapi.MessageBatchCreateRequest)
    batches = MessageBatches(context.batches)
    return ModelResponse(await batches.create(context.access.owner(request), body))


async def message_batch_results(request: Request) -> Response:
    context = _context(request)
    batch_id = request.path_params["message_batch_id"]
    content = await MessageBatches(context.batches).results(context.access.owner(request), batch_id)
    return Response(content, media_type="application/x-jsonl")


OwnedCall = Callable[[BatchService, str, Request], Awaitable[BaseModel]]


def owned(call: OwnedCall) -> Handler:
    """A route of the Files and Batch APIs: `call(batches, owner, request)`, with the caller's
    owner (whose files and jobs it may see), answered with the object it returns."""

    async def handle(request: Request) -> Response:
        context = _context(request)
        return ModelResponse(await call(context.batches, context.access.owner(request), request))

    return handle


async def dashboard_feed(request: Request) -> Response:
    gateway = _context(request).gateway
    gateway.check_available()
    return EventStreamResponse(dashboard.feed(gateway, DASHBOARD_FEED_INTERVAL_SECONDS))


def web_file(file: WebFile) -> Handler:
    async def serve_file(request: Request) -> Response:
        return Response(file.content, media_type=file.media_type, headers=HEADERS)

    return serve_file


# A route of Anthropic's APIs: its errors in Anthropic's shape.
anthropic_endpoint = functools.partial(
    Endpoint, error_model=aapi.MessagesErrorResponse, error_body=anthropic.error_body
)

ENDPOINTS = [
    Endpoint(
        "/v1/chat/completions",
        "POST",
        "Chat completion (OpenAI)",
        chat_completions,
        api.ChatCompletionRequest,
        api.ChatCompletionResponse,
        api.ChatCompletionChunk,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/v1/responses",
        "POST",
        "Response (OpenAI Responses API, stateless: nothing is stored)",
        create_response,
        rapi.ResponsesRequest,
        rapi.Response,
        rapi.ResponseEvent,
        stream_done=False,
        errors=BODY_ERRORS,
    ),
    anthropic_endpoint(
        "/v1/messages",
        "POST",
        "Message (Anthropic Messages API, stateless)",
        create_message,
        aapi.MessagesRequest,
        aapi.Message,
        aapi.StreamEvent,
        stream_done=False,
        errors=BODY_ERRORS,
    ),
    anthropic_endpoint(
        "/v1/messages/count_tokens",
        "POST",
        "The prompt's length in tokens (Anthropic Messages API)",
        count_message_tokens,
        aapi.CountTokensRequest,
        aapi.TokenCount,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/v1/completions",
        "POST",
        "Text completion (OpenAI)",
        text_completions,
        api.CompletionRequest,
        api.CompletionResponse,
        api.CompletionResponse,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/v1/embeddings",
        "POST",
        "Embeddings (OpenAI): each input's pooled hidden state, unit length",
        create_embeddings,
        eapi.EmbeddingRequest,
        eapi.EmbeddingResponse,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/v1/score",
        "POST",
        "Scores of text pairs (vLLM): the cosine similarity of their embeddings",
        score,
        eapi.ScoreRequest,
        eapi.ScoreResponse,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/v1/rerank",
        "POST",
        "Documents by relevance to a query (vLLM; Jina and Cohere shapes), by embedding cosine",
        rerank,
        eapi.RerankRequest,
        eapi.RerankResponse,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/v1/models",
        "GET",
        "The served model, and its LoRA adapters (parent: the base model); in Anthropic's shape "
        "when the request carries anthropic-version",
        models,
        None,
        api.ModelList,
        errors=SERVICE_ERRORS,
    ),
    Endpoint(
        # A model id may hold slashes ("Qwen/Qwen3-0.6B").
        "/v1/models/{model:path}",
        "GET",
        "One of /v1/models' entries, by its id (OpenAI's retrieve; Anthropic's with "
        "anthropic-version)",
        model,
        None,
        api.ModelCard,
        errors=(404, *SERVICE_ERRORS),
    ),
    Endpoint(
        "/v1/load_lora_adapter",
        "POST",
        "Serve a LoRA adapter from the engines' --lora-root under a model name (vLLM)",
        load_lora_adapter,
        api.LoadLoraAdapterRequest,
        api.LoraAdapterStatus,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/v1/unload_lora_adapter",
        "POST",
        "Stop serving a LoRA adapter; answers once its requests have ended (vLLM)",
        unload_lora_adapter,
        api.UnloadLoraAdapterRequest,
        api.LoraAdapterStatus,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/tokenize",
        "POST",
        "Text or chat messages to token ids (vLLM)",
        tokenize,
        api.TokenizeRequest,
        api.TokenizeResponse,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/detokenize",
        "POST",
        "Token ids to text (vLLM)",
        detokenize,
        api.DetokenizeRequest,
        api.DetokenizeResponse,
        errors=BODY_ERRORS,
    ),
    Endpoint(
        "/health",
        "GET",
        "200 when the engine and tokenizer serve, else 503",
        health,
        None,
        api.HealthResponse,
        answers=(200, 503),
        errors=ANY_ROUTE_ERRORS,
    ),
    Endpoint(
        "/metrics",
        "GET",
        "Prometheus metrics (text format 0.0.4)",
        metrics,
        media_type="text/plain",
        errors=ANY_ROUTE_ERRORS,
    ),
    Endpoint(
        "/server_info",
        "GET",
        "The served model and the engines' capacity, as SGLang answers it (for SMG)",
        server_info,
        None,
        smg.ServerInfo,
        errors=SERVICE_ERRORS,
    ),
    Endpoint(
        "/model_info",
        "GET",
        "The served model, as SGLang answers it (for SMG)",
        model_info,
        None,
        smg.ModelInfo,
        errors=SERVICE_ERRORS,
    ),
    Endpoint(
        "/v1/loads",
        "GET",
        "The engines' load, as SGLang answers it (SMG's load-aware policies poll it)",
        loads,
        None,
        smg.Loads,
        errors=SERVICE_ERRORS,
    ),
    Endpoint(
        "/v1/files",
        "POST",
        "Upload a file (OpenAI Files API; purpose batch: a batch job's JSONL input)",
        create_file,
        bapi.FileUpload,
        bapi.FileObject,
        request_media_type=MULTIPART,
        errors=(400, 413, 415, *ANY_ROUTE_ERRORS),
    ),
    Endpoint(
        "/v1/files",
        "GET",
        "The caller's files",
        owned(lambda b, owner, r: b.files(owner, parse_query(bapi.FileListQuery, r.query_params))),
        None,
        bapi.FileList,
        query=bapi.FileListQuery,
        errors=(400, *ANY_ROUTE_ERRORS),
    ),
    Endpoint(
        "/v1/files/{file_id}",
        "GET",
        "One of the caller's files",
        owned(lambda b, owner, r: b.file(owner, r.path_params["file_id"])),
        None,
        bapi.FileObject,
        errors=(404, *ANY_ROUTE_ERRORS),
    ),
    Endpoint(
        "/v1/files/{file_id}",
        "DELETE",
        "Delete one of the caller's files",
        owned(lambda b, owner, r: b.delete_file(owner, r.path_params["file_id"])),
        None,
        bapi.FileDeleted,
        errors=(404, *ANY_ROUTE_ERRORS),
    ),
    Endpoint(
        "/v1/files/{file_id}/content",
        "GET",
        "A file's content (a batch's output and error files are JSONL)",
        file_content,
        media_type="application/octet-stream",
        errors=(404, *ANY_ROUTE_ERRORS),
    ),
    Endpoint(
        "/v1/batches",
        "POST",
        "Create a batch job over an uploaded file (OpenAI Batch API); it runs in the background, "
        "in the engine's batch lane",
        create_batch,
        bapi.BatchCreateRequest,
        bapi.Batch,
        errors=(400, 404, 413, 415, *ANY_ROUTE_ERRORS),
    ),
    Endpoint(
        "/v1/batches",
        "GET",
        "The caller's batch jobs, newest first",
        owned(
            lambda b, owner, r: b.batches(owner, parse_query(bapi.BatchListQuery, r.query_params))
        ),
        None,
        bapi.BatchList,
        query=bapi.BatchListQuery,
        errors=(400, *ANY_ROUTE_ERRORS),
    ),
    Endpoint(
        "/v1/batches/{batch_id}",
        "GET",
        "One of the caller's batch jobs",
        owned(lambda b, owner, r: b.batch(owner, r.path_params["batch_id"])),
        None,
        bapi.Batch,
        errors=(404, *ANY_ROUTE_ERRORS),
    ),
    Endpoint(
        "/v1/batches/{batch_id}/cancel",
        "POST",
        "Cancel a batch job (cancelling, then cancelled with what was answered)",
        owned(lambda b, owner, r: b.cancel_batch(owner, r.path_params["batch_id"])),
        None,
        bapi.Batch,
        errors=(404, *ANY_ROUTE_ERRORS),
    ),
    anthropic_endpoint(
        "/v1/messages/batches",
        "POST",
        "Create a message batch (Anthropic Message Batches API); it runs in the background, "
        "in the engine's batch lane",
        create_message_batch,
        aapi.MessageBatchCreateRequest,
        aapi.MessageBatch,
        errors=(400, 413, 415, *ANY_ROUTE_ERRORS),
    ),
    anthropic_endpoint(
        "/v1/messages/batches",
        "GET",
        "The caller's message batches, newest first",
        owned(
            lambda b, owner, r: MessageBatches(b).list_batches(
                owner, parse_query(aapi.MessageBatchListQuery, r.query_params), str(r.base_url)
            )
        ),
        None,
        aapi.MessageBatchList,
        query=aapi.MessageBatchListQuery,
        errors=(400, *ANY_ROUTE_ERRORS),
    ),
    anthropic_endpoint(
        "/v1/messages/batches/{message_batch_id}",
        "GET",
        "One of the caller's message batches",
        owned(
            lambda b, owner, r: MessageBatches(b).retrieve(
                owner, r.path_params["message_batch_id"], str(r.base_url)
            )
        ),
        None,
        aapi.MessageBatch,
        errors=(404, *ANY_ROUTE_ERRORS),
    ),
    anthropic_endpoint(
        "/v1/messages/batches/{message_batch_id}",
        "DELETE",
        "Delete an ended message batch and its results",
        owned(
            lambda b, owner, r: MessageBatches(b).delete(owner, r.path_params["message_batch_id"])
        ),
        None,
        aapi.DeletedMessageBatch,
        errors=(400, 404, *ANY_ROUTE_ERRORS),
    ),
    anthropic_endpoint(
        "/v1/messages/batches/{message_batch_id}/cancel",
        "POST",
        "Cancel a message batch: what runs is aborted, what waits is canceled",
        owned(
            lambda b, owner, r: MessageBatches(b).cancel(
                owner, r.path_params["message_batch_id"], str(r.base_url)
            )
        ),
        None,
        aapi.MessageBatch,
        errors=(404, *ANY_ROUTE_ERRORS),
    ),
    anthropic_endpoint(
        "/v1/messages/batches/{message_batch_id}/results",
        "GET",
        "An ended message batch's results, a JSON line per request",
        message_batch_results,
        media_type="application/x-jsonl",
        errors=(400, 404, *ANY_ROUTE_ERRORS),
    ),
    Endpoint("/openapi.json", "GET", "This document", openapi, errors=ANY_ROUTE_ERRORS),
]

# The web pages (off with --no-webui): open to anyone, but for their feed, protected as /metrics.
WEB_PAGE_SUMMARIES = {
    "/": "The playground (web page)",
    "/dashboard": "The live dashboard (web page)",
}
WEBUI_ENDPOINTS = [
    *(
        Endpoint(
            path,
            "GET",
            WEB_PAGE_SUMMARIES.get(path, "A script or style of the web pages"),
            web_file(file),
            media_type=file.media_type.split(";")[0],
        )
        for path, file in load_web_files().items()
    ),
    Endpoint(
        "/dashboard/feed",
        "GET",
        "The dashboard's live numbers: server-sent events, one sample every "
        f"{DASHBOARD_FEED_INTERVAL_SECONDS:g} s, for as long as the client reads",
        dashboard_feed,
        media_type="text/event-stream",
        errors=(*ANY_ROUTE_ERRORS, 503),
    ),
]


def guarded(handler: Handler, body_of: ErrorBody = error_body) -> Handler:
    """`handler` behind the caller's key and rate check, with the request's deadline set and
    any failure answered with the error body `body_of` writes."""

    async def run(request: Request) -> Response:
        context = _context(request)
        try:
            request.state.caller = context.access.admit_http(request)
            # Unary calls to the services made for this request carry what is left of it.
            request.state.deadline = time.monotonic() + context.config.request_timeout
            set_deadline(request.state.deadline)
            # The engine schedules it by its tenant and deadlines (headers, the key's settings).
            set_service_level(
                context.access.service_levels.of(request.state.caller, request.headers)
            )
            # Prefixes it pins count against its key's bound (gateway.engines.pinning).
            set_pin_owner(context.access.owner(request), context.config.max_pinned_gib_per_key)
            return await handler(request)
        except ClientDisconnect:
            return Response(status_code=499)  # it left while sending its body
        except Exception as exc:
            return error_response(exc, body_of)

    return run


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return ModelResponse(
        api.ErrorResponse(
            error=api.ErrorInfo(
                message=f"{request.method} {request.url.path}: {exc.detail}", type=kind
            )
        ),
        exc.status_code,
    )


def build_app(
    gateway: Gateway,
    batches: BatchService,
    config: GatewayConfig | None = None,
    access: Access | None = None,
) -> Starlette:
    """The app; `access` (the keys and rate limits) may be shared with the gRPC API; `batches`
    serves the Files and Batch APIs (its runner started by whoever owns the loop)."""
    config = config or GatewayConfig()
    endpoints = ENDPOINTS + WEBUI_ENDPOINTS if config.webui else ENDPOINTS
    routes = [
        Route(e.path, guarded(e.handler, e.error_body), methods=[e.method])
        for e in endpoints
        if e.handler is not None
    ]
    # Browsers on the allowed origins may call the API; preflights are answered before any
    # route (they carry no key). None: same-origin only.
    cors = (
        [
            Middleware(
                CORSMiddleware,
                allow_origins=config.allowed_origins,
                allow_methods=["*"],
                allow_headers=["*"],
            )
        ]
        if config.allowed_origins
        else []
    )
    app = Starlette(routes=routes, middleware=cors, exception_handlers={HTTPException: http_error})
    app.state.context = AppContext(
        gateway,
        config,
        access or Access(config),
        batches,
        # The installed package's version (pyproject.toml's): read here, once a gateway
        # builds its app, not at every process's import of the config (~30 ms).
        json.dumps(openapi_document(endpoints, "Folio", importlib.metadata.version("folio"))),
    )
    return app
