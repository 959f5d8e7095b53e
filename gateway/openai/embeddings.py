"""Embeddings, scores and reranking over the token pipeline: OpenAI's /v1/embeddings, vLLM's
/v1/score and /v1/rerank.

Each input becomes one embedding request (validation.embedding_request): the engine computes its
prompt once and pools it the model's way (last token, mean or CLS; engine/pooler.py), normalised
to unit length. A score is the cosine similarity of two such vectors (their dot product), as vLLM
scores with an embedding model that has no classifier head; reranking orders the documents by
their score against the query. Cross-encoders (a classifier head reading query and document
together) are not served.

`plan_*` validate a request and say what to run (a PoolingPlan); `answer` runs it through the
`serve` function the caller hands in (the HTTP routes' is front/serving.py's, with the caller's
rate limits and deadline; the batch runner brings its own) and builds the response body.
`create_embeddings` does both for one /v1/embeddings body, as a dict. This module never parses
HTTP and never talks to a service except through the gateway and `serve`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from common.errors import DeadlineExceededError, FolioError, UnavailableError
from common.finish_reason import FinishReason
from common.pooling_params import PoolingParams
from gateway.openai import embeddings_protocol as eapi
from gateway.openai.protocol import InvalidParameter
from gateway.pipeline.generation import Gateway, new_request_id
from gateway.pipeline.text import TextDelta, TextRequest
from gateway.pipeline.validation import ModelInfo, embedding_request

T = TypeVar("T")
# How the caller runs a plan's requests: (requests, request id) -> (choice index, delta).
Serve = Callable[[Sequence[TextRequest], str], AsyncGenerator[tuple[int, TextDelta], None]]


@dataclass
class PoolingPlan:
    """A validated embedding, score or rerank request: what to run and how to answer."""

    id: str
    model: str
    requests: list[TextRequest]  # one per input to embed
    # The response body from each request's vector (in request order) and the prompt tokens.
    respond: Callable[[list[list[float]], int], BaseModel]


async def _requests(
    gateway: Gateway,
    info: ModelInfo,
    inputs: Sequence[str | list[int]],
    param: str,
    pooling: PoolingParams,
    priority: int,
    truncate_prompt_tokens: int | None = None,
) -> list[TextRequest]:
    """One embedding request per input (a text, tokenized with the model's special tokens, or
    token ids); InvalidParameter naming `param` (with the input's index) for a bad one."""
    texts = [text for text in inputs if isinstance(text, str)]
    for i, text in enumerate(inputs):
        if isinstance(text, str) and not text:
            raise InvalidParameter(f"{param}[{i}] must not be an empty string", param)
    tokenized = iter(await asyncio.gather(*(gateway.tokenize_text(text) for text in texts)))
    requests = []
    for i, item in enumerate(inputs):
        ids = list(next(tokenized).token_ids) if isinstance(item, str) else item
        where = param if len(inputs) == 1 else f"{param}[{i}]"
        try:
            requests.append(
                embedding_request(
                    info,
                    ids,
                    pooling,
                    priority=priority,
                    prompt_param=where,
                    truncate_prompt_tokens=truncate_prompt_tokens,
                )
            )
        except InvalidParameter as exc:
            raise InvalidParameter(str(exc), param if exc.param == where else exc.param) from None
    return requests


def _counted(values: list[T], param: str) -> list[T]:
    """`values`, unless empty or over OpenAI's bound on inputs (InvalidParameter)."""
    if not values:
        raise InvalidParameter(f"{param} must not be empty", param)
    if len(values) > eapi.MAX_INPUTS:
        raise InvalidParameter(
            f"{param} has {len(values)} items, over the limit of {eapi.MAX_INPUTS}", param
        )
    return values


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def plan_embeddings(
    gateway: Gateway, body: eapi.EmbeddingRequest, priority: int = 0
) -> PoolingPlan:
    info = await gateway.check_model(body.model)
    raw = body.input
    inputs: list[str | list[int]]
    if isinstance(raw, str):
        inputs = [raw]
    elif raw and all(isinstance(v, int) for v in raw):
        inputs = [[v for v in raw if isinstance(v, int)]]  # one prompt's token ids
    else:
        inputs = _counted([v for v in raw if not isinstance(v, int)], "input")
    pooling = PoolingParams(body.dimensions)
    pooling.validate()
    requests = await _requests(
        gateway, info, inputs, "input", pooling, priority, body.truncate_prompt_tokens
    )

    def respond(vectors: list[list[float]], prompt_tokens: int) -> BaseModel:
        return eapi.EmbeddingResponse(
            data=[
                eapi.Embedding(index=i, embedding=_encoded(vector, body.encoding_format))
                for i, vector in enumerate(vectors)
            ],
            model=info.name,
            usage=eapi.EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )

    return PoolingPlan(new_request_id("embd"), info.name, requests, respond)


def _cosine(a: list[float], b: list[float]) -> float:
    """The vectors are unit length: their dot product is their cosine."""
    return sum(x * y for x, y in zip(a, b, strict=True))


async def plan_score(gateway: Gateway, body: eapi.ScoreRequest, priority: int = 0) -> PoolingPlan:
    info = await gateway.check_model(body.model)
    first = _counted([body.text_1] if isinstance(body.text_1, str) else body.text_1, "text_1")
    second = _counted([body.text_2] if isinstance(body.text_2, str) else body.text_2, "text_2")
    if len(first) > 1 and len(first) != len(second):
        raise InvalidParameter(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: score one against one, "
            "one against many, or lists of the same length pairwise",
            "text_2",
        )
    requests = await _requests(gateway, info, first, "text_1", PoolingParams(), priority)
    requests += await _requests(gateway, info, second, "text_2", PoolingParams(), priority)
    created = int(time.time())
    request_id = new_request_id("score")

    def respond(vectors: list[list[float]], prompt_tokens: int) -> BaseModel:
        left, right = vectors[: len(first)], vectors[len(first) :]
        scores = [_cosine(left[i if len(left) > 1 else 0], v) for i, v in enumerate(right)]
        return eapi.ScoreResponse(
            id=request_id,
            created=created,
            model=info.name,
            data=[eapi.ScoreData(index=i, score=score) for i, score in enumerate(scores)],
            usage=eapi.EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )

    return PoolingPlan(request_id, info.name, requests, respond)


async def plan_rerank(gateway: Gateway, body: eapi.RerankRequest, priority: int = 0) -> PoolingPlan:
    info = await gateway.check_model(body.model)
    documents = _counted(body.documents, "documents")
    requests = await _requests(gateway, info, [body.query], "query", PoolingParams(), priority)
    requests += await _requests(gateway, info, documents, "documents", PoolingParams(), priority)
    request_id = new_request_id("rerank")

    def respond(vectors: list[list[float]], prompt_tokens: int) -> BaseModel:
        query = vectors[0]
        scores = [_cosine(query, v) for v in vectors[1:]]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        results = [
            eapi.RerankResult(
                index=i,
                relevance_score=scores[i],
                document=eapi.RerankDocument(text=documents[i]) if body.return_documents else None,
            )
            for i in order[: body.top_n or None]
        ]
        return eapi.RerankResponse(
            id=request_id,
            model=info.name,
            results=results,
            usage=eapi.RerankUsage(total_tokens=prompt_tokens),
        )

    return PoolingPlan(request_id, info.name, requests, respond)


async def answer(plan: PoolingPlan, serve: Serve) -> BaseModel:
    """Run the plan's requests through `serve`; the response body."""
    vectors: list[list[float] | None] = [None] * len(plan.requests)
    prompt_tokens = 0
    async with contextlib.aclosing(serve(plan.requests, plan.id)) as stream:
        async for index, delta in stream:
            if delta.embedding is not None:
                vectors[index] = delta.embedding
            elif delta.finish_reason is not None:
                raise _ended_unpooled(index, delta.finish_reason)
            if delta.usage is not None:
                prompt_tokens += delta.usage.prompt_tokens
    return plan.respond([v for v in vectors if v is not None], prompt_tokens)


def _ended_unpooled(index: int, reason: str) -> FolioError:
    """An input the engine ended before pooling it: past its deadline (the request's service
    level), or aborted there (the engine stopped)."""
    if reason == FinishReason.DEADLINE:
        return DeadlineExceededError(f"input {index} reached its deadline before it was pooled")
    return UnavailableError(f"the engine ended input {index} ({reason}) before it was pooled")


async def create_embeddings(
    gateway: Gateway, body: eapi.EmbeddingRequest, serve: Serve, priority: int = 0
) -> dict[str, Any]:
    """One /v1/embeddings body answered: the response as a JSON-ready dict."""
    response = await answer(await plan_embeddings(gateway, body, priority), serve)
    return response.model_dump(mode="json")
