"""The shapes of the embedding APIs (pydantic v2): OpenAI's /v1/embeddings, and vLLM's /v1/score
(text_1 / text_2 pairs) and /v1/rerank (a query and documents, Jina and Cohere style).

Shapes and types only: what each field may hold beyond its type (non-empty inputs, the context,
Matryoshka dimensions) is embeddings.py's, the engine's and validation.py's to say.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.openai.protocol import INT32_MAX, INT32_MIN, RequestBody, ResponseBody

# OpenAI's own bound on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    model: str | None = None
    # A text, texts, one prompt's token ids, or several prompts' token ids.
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, a list of token ids or a list of lists of them"
    )
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka models only: the vector's first `dimensions` values, normalised again (an
    # int32 on the wire to the engine).
    dimensions: int | None = Field(None, le=INT32_MAX)
    user: str | None = None
    # vLLM's: embed each input's last N tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)


class Embedding(ResponseBody):
    object: Literal["embedding"] = "embedding"
    index: int
    # The floats, or (encoding_format base64) their little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingUsage(ResponseBody):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseBody):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ScoreRequest(RequestBody):
    """Score text_1 against text_2: one against one, one against each of many, or pairwise
    (lists of the same length)."""

    model: str | None = None
    text_1: str | list[str] = Field(description="A string or a list of strings")
    text_2: str | list[str] = Field(description="A string or a list of strings")


class ScoreData(ResponseBody):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(ResponseBody):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(RequestBody):
    model: str | None = None
    query: str
    documents: list[str]
    # The best top_n documents; unset (or 0): all of them.
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True


class RerankDocument(ResponseBody):
    text: str


class RerankResult(ResponseBody):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(ResponseBody):
    total_tokens: int


class RerankResponse(ResponseBody):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
