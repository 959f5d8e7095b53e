"""/v1/embeddings, /v1/score and /v1/rerank through the real gateway, tokenizer and engine
services, with the real openai client: vectors equal transformers' final hidden states pooled
the model's way (cosine > 0.9999, float32), on a tiny random sentence-transformers model (mean
pooling, Matryoshka dimensions, served for embeddings only) and on the default model (last
token, beside generation traffic in the same engine); base64 is the same floats; scores and
reranking order; bad input is a 400 naming the parameter."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import EngineConfig
from common.errors import DeadlineExceededError, UnavailableError
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from embedding_models import cosine, reference_embedding, write_sentence_transformers
from gateway.openai import embeddings
from gateway.pipeline.text import TextDelta, TextRequest, Usage
from gateway_helpers import GatewayThread, check_error
from grpc_helpers import ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import hf_greedy, make_tiny_smollm2

COSINE = 0.9999
TINY_MAX_MODEL_LEN = 96
TEXTS = ["Paged attention keeps the KV cache in blocks.", "A haiku about the sea", "x"]


class Stack:
    """Tokenizer and engine services on a model, the gateway before them, an openai client."""

    def __init__(self, model_dir, **engine_args) -> None:
        self.tokenizer_service = ServerThread(TokenizerService(str(model_dir), "127.0.0.1", 0))
        self.engine = ServerThread(
            EngineService(EngineConfig(model=str(model_dir), **engine_args), "127.0.0.1", 0)
        )
        self.gateway = GatewayThread(
            f"127.0.0.1:{self.engine.port}", f"127.0.0.1:{self.tokenizer_service.port}"
        )
        self.url = self.gateway.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def close(self) -> None:
        self.client.close()
        self.gateway.close()
        self.engine.close()
        self.tokenizer_service.close()


ENGINE = dict(dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """A tiny random SmolLM2 packaged as a sentence-transformers model (mean pooling) that
    declares Matryoshka sizes: the pooling runner serves it, embeddings only. A small step
    budget makes longer inputs prefill in chunks."""
    directory = make_tiny_smollm2(tmp_path_factory.mktemp("tiny-embedder"), default_model_dir)
    write_sentence_transformers(directory, "mean")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [32]}))
    stack = Stack(
        directory,
        **ENGINE,
        num_kv_blocks=64,
        max_model_len=TINY_MAX_MODEL_LEN,
        max_num_batched_tokens=16,
    )
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def default(default_model_dir):
    """The default model in float32, served for generation (and embeddings: last token)."""
    stack = Stack(default_model_dir, **ENGINE, num_kv_blocks=128, max_model_len=512)
    yield stack
    stack.close()


def expected(stack: Stack, text: str | list[int], pooling: str) -> torch.Tensor:
    ids = stack.tokenizer.encode(text) if isinstance(text, str) else text
    return reference_embedding(stack.reference, ids, pooling)


def test_embeddings_equal_transformers_mean_pooled_whole_and_chunked(tiny):
    long_text = " ".join(["tokens"] * 30)  # over the 16-token step budget: three chunks
    inputs = [*TEXTS, long_text]
    response = tiny.client.embeddings.create(
        model="tiny-embedder0", input=inputs, encoding_format="float"
    )
    assert [d.index for d in response.data] == list(range(len(inputs)))
    for text, data in zip(inputs, response.data, strict=True):
        assert len(data.embedding) == 64
        assert cosine(data.embedding, expected(tiny, text, "mean")) > COSINE
    lengths = [len(tiny.tokenizer.encode(t)) for t in inputs]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(lengths)


def test_base64_is_the_same_floats(tiny):
    body = {"input": TEXTS, "encoding_format": "base64"}
    encoded = httpx.post(tiny.url + "/v1/embeddings", json=body).json()["data"]
    floats = httpx.post(tiny.url + "/v1/embeddings", json={"input": TEXTS}).json()["data"]
    for b64, plain in zip(encoded, floats, strict=True):
        raw = base64.b64decode(b64["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == plain["embedding"]
    # The openai client asks for base64 unless told otherwise, and decodes it.
    decoded = tiny.client.embeddings.create(model="tiny-embedder0", input=TEXTS).data
    assert [d.embedding for d in decoded] == [d["embedding"] for d in floats]


def test_token_id_inputs(tiny):
    ids = tiny.tokenizer.encode(TEXTS[0])
    one = tiny.client.embeddings.create(model="tiny-embedder0", input=ids, encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids)
    assert cosine(one.data[0].embedding, expected(tiny, ids, "mean")) > COSINE
    many = tiny.client.embeddings.create(
        model="tiny-embedder0", input=[ids, [5, 6, 7]], encoding_format="float"
    )
    assert many.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
    assert cosine(many.data[1].embedding, expected(tiny, [5, 6, 7], "mean")) > COSINE


def test_matryoshka_dimensions(tiny):
    full = expected(tiny, TEXTS[0], "mean")
    cut = tiny.client.embeddings.create(
        model="tiny-embedder0", input=TEXTS[0], dimensions=32, encoding_format="float"
    )
    vector = cut.data[0].embedding
    assert len(vector) == 32
    assert sum(v * v for v in vector) == pytest.approx(1.0, abs=1e-5)
    assert cosine(vector, full[:32]) > COSINE
    response = httpx.post(tiny.url + "/v1/embeddings", json={"input": "a", "dimensions": 16})
    check_error(response, 400, "dimensions")


def test_score_and_rerank_order(tiny):
    query, documents = TEXTS[0], ["blocks of KV cache", TEXTS[0], "the sea"]
    vectors = [expected(tiny, text, "mean") for text in [query, *documents]]
    scores = [cosine(vectors[0], v) for v in vectors[1:]]
    scored = httpx.post(tiny.url + "/v1/score", json={"text_1": query, "text_2": documents})
    assert scored.status_code == 200, scored.text
    body = scored.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["score"] for d in body["data"]] == pytest.approx(scores, abs=1e-4)
    pairwise = httpx.post(
        tiny.url + "/v1/score", json={"text_1": [query, query], "text_2": documents[:2]}
    ).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(scores[:2], abs=1e-4)

    ranked = httpx.post(
        tiny.url + "/v1/rerank", json={"query": query, "documents": documents, "top_n": 2}
    )
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    best_first = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in results] == best_first
    assert results[0]["index"] == 1  # the query itself, score 1
    assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
    assert [r["document"]["text"] for r in results] == [documents[i] for i in best_first]
    assert ranked.json()["usage"]["total_tokens"] == sum(
        len(tiny.tokenizer.encode(t)) for t in [query, *documents]
    )


def test_the_endpoints_are_in_the_openapi_document(tiny):
    paths = httpx.get(tiny.url + "/openapi.json").json()["paths"]
    for path in ("/v1/embeddings", "/v1/score", "/v1/rerank"):
        assert set(paths[path]["post"]["responses"]) >= {"200", "400"}


def test_the_pooling_runner_refuses_generation(tiny):
    response = httpx.post(tiny.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert "embeddings only" in response.json()["error"]["message"]


TRUNCATE = "truncate_prompt_tokens"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ["a", ""]}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/v1/embeddings", {"input": 5}, "input"),
        ("/v1/embeddings", {"input": [1, "a"]}, "input"),
        ("/v1/embeddings", {"input": [1, 10**9]}, "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "dimensions": "32"}, "dimensions"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "a", "dimensions": 159983695950407}, "dimensions"),
        ("/v1/embeddings", {}, "input"),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": -2}, TRUNCATE),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 10**6}, TRUNCATE),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": 3, "text_2": "a"}, "text_1"),
        ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "a", "documents": ["a"], "top_n": -1}, "top_n"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(tiny, path, body, param):
    check_error(httpx.post(tiny.url + path, json=body), 400, param)


def test_an_input_over_the_context_names_max_model_len(tiny):
    too_long = list(range(3, 3 + TINY_MAX_MODEL_LEN + 1))
    error = check_error(
        httpx.post(tiny.url + "/v1/embeddings", json={"input": too_long}), 400, "input"
    )
    assert "max_model_len" in error["message"]
    full = httpx.post(tiny.url + "/v1/embeddings", json={"input": too_long[:-1]})
    assert full.status_code == 200, full.text  # an input may fill the context
    # Truncated (vLLM's truncate_prompt_tokens), it is its last tokens' embedding.
    for keep, tail in ((-1, too_long[1:]), (5, too_long[-5:])):
        body = {"input": too_long, "truncate_prompt_tokens": keep, "encoding_format": "float"}
        truncated = httpx.post(tiny.url + "/v1/embeddings", json=body).json()
        whole = httpx.post(
            tiny.url + "/v1/embeddings", json={"input": tail, "encoding_format": "float"}
        ).json()
        assert truncated["usage"]["prompt_tokens"] == len(tail)
        assert truncated["data"][0]["embedding"] == whole["data"][0]["embedding"]


def test_default_model_embeddings_beside_generation(default):
    prompt_ids = default.tokenizer.encode("The capital of France is")
    want_text = default.tokenizer.decode(hf_greedy(default.reference, prompt_ids, 8))

    def generate() -> str:
        completion = default.client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt_ids, max_tokens=8, temperature=0
        )
        return completion.choices[0].text

    def embed() -> list[list[float]]:
        response = default.client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS)
        return [d.embedding for d in response.data]

    with ThreadPoolExecutor(4) as pool:
        texts = [pool.submit(generate) for _ in range(2)]
        vectors = [pool.submit(embed) for _ in range(2)]
        assert [t.result() for t in texts] == [want_text] * 2
        for future in vectors:
            for text, vector in zip(TEXTS, future.result(), strict=True):
                assert len(vector) == 576
                assert cosine(vector, expected(default, text, "last")) > COSINE
    # No Matryoshka sizes declared: dimensions is refused, naming it.
    response = httpx.post(default.url + "/v1/embeddings", json={"input": "a", "dimensions": 8})
    assert "Matryoshka" in check_error(response, 400, "dimensions")["message"]


@pytest.mark.parametrize(
    ("reason", "error"), [("deadline", DeadlineExceededError), ("abort", UnavailableError)]
)
def test_an_input_the_engine_ends_unpooled_fails_the_request(reason, error):
    """The engine ends an embedding request without its vector only past its deadline or when
    it aborts it: the request fails (504, 503), and the inputs still running are released."""
    requests = [TextRequest([1], SamplingParams(max_tokens=0)) for _ in range(3)]
    plan = embeddings.PoolingPlan("embd-1", "m", requests, lambda vectors, tokens: None)
    closed = []

    async def serve(requests, request_id):
        try:
            yield 0, TextDelta("", finish_reason="stop", usage=Usage(1, 0), embedding=[1.0])
            yield 1, TextDelta("", finish_reason=reason, usage=Usage(1, 0))
            yield 2, TextDelta("", finish_reason="stop", usage=Usage(1, 0), embedding=[1.0])
        finally:
            closed.append(request_id)

    with pytest.raises(error, match="input 1"):
        asyncio.run(embeddings.answer(plan, serve))
    assert closed == ["embd-1"]
