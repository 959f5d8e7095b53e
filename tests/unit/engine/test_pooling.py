"""Embedding requests in the engine, on tiny random float32 models: the pooled vector (last
token, mean, CLS, from the model's sentence-transformers config) equals transformers' final
hidden states pooled the same way, whole or prefilled in chunks; Matryoshka truncation where
the config declares it (refused, naming dimensions, where it does not); embedding and generation
requests in one engine both right; an embedding request leaves no KV behind and never touches
the prefix cache; the pooling runner refuses generation."""

from __future__ import annotations

import json

import pytest
import torch
from test_prompt_logprobs import random_prompt as prompt
from test_prompt_logprobs import tiny_engine as prompt_logprobs_engine

from common.config import EngineConfig
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from embedding_models import cosine, reference_embedding, write_sentence_transformers
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.simulated import StepCostModel, simulated_engine
from tiny_models import VARIANTS, hf_greedy, make_checkpoint

COSINE = 0.9999
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-pooling")
    return directory, make_checkpoint(directory, *VARIANTS["llama"])


def tiny_engine(directory, **overrides) -> LLMEngine:
    """test_prompt_logprobs' tiny engine; a 16-token step budget prefills a 40-token prompt in
    three chunks, and eager steps leave no decode programs to compile."""
    return prompt_logprobs_engine(
        directory, **{"max_num_batched_tokens": 16, "enforce_eager": True, **overrides}
    )


def run(engine: LLMEngine) -> tuple[dict, dict]:
    """Every request to its end: generated tokens and embeddings by request id."""
    tokens: dict[str, list[int]] = {}
    embeddings: dict[str, list[float]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.embedding is not None:
                assert out.finished and out.request_id not in embeddings
                embeddings[out.request_id] = out.embedding
    return tokens, embeddings


def sentence_transformers_copy(directory, target, pooling: str):
    """The checkpoint's files linked into `target`, packaged as a sentence-transformers model."""
    target.mkdir()
    for file in directory.iterdir():
        (target / file.name).symlink_to(file)
    return write_sentence_transformers(target, pooling)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_vectors_match_transformers_whole_and_chunked(checkpoint, pooling, tmp_path):
    directory, reference = checkpoint
    model_dir = sentence_transformers_copy(directory, tmp_path / "model", pooling)
    engine = tiny_engine(model_dir)  # a sentence-transformers model: the pooling runner
    prompts = {"short": prompt(5, 1), "one": prompt(1, 2), "chunked": prompt(40, 3)}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, SamplingParams(), pooling=PoolingParams())
    _, embeddings = run(engine)
    for request_id, ids in prompts.items():
        expected = reference_embedding(reference, ids, pooling)
        assert cosine(embeddings[request_id], expected) > COSINE, request_id
        assert sum(v * v for v in embeddings[request_id]) == pytest.approx(1.0, abs=1e-5)
    assert engine.kv_cache.usage == 0  # nothing kept
    with pytest.raises(InvalidRequestError, match="embeddings only"):
        engine.add_request("text", prompts["short"], GREEDY)


def test_embeddings_beside_generation_in_one_engine(checkpoint):
    directory, reference = checkpoint
    engine = tiny_engine(directory)  # no sentence-transformers config: generate, last token
    shared = prompt(12, 4)
    engine.add_request("gen-a", shared, GREEDY)
    engine.add_request("emb-a", shared, SamplingParams(), pooling=PoolingParams())
    engine.add_request("emb-b", prompt(30, 5), SamplingParams(), pooling=PoolingParams())
    engine.add_request("gen-b", prompt(20, 6), GREEDY)
    tokens, embeddings = run(engine)
    assert tokens["gen-a"] == hf_greedy(reference, shared, 5)
    assert tokens["gen-b"] == hf_greedy(reference, prompt(20, 6), 5)
    assert tokens["emb-a"] == tokens["emb-b"] == []
    assert set(embeddings) == {"emb-a", "emb-b"}
    assert cosine(embeddings["emb-a"], reference_embedding(reference, shared, "last")) > COSINE
    emb_b = reference_embedding(reference, prompt(30, 5), "last")
    assert cosine(embeddings["emb-b"], emb_b) > COSINE


def test_mean_pooling_after_a_preemption_in_the_middle_of_the_prefill(checkpoint, tmp_path):
    directory, reference = checkpoint
    model_dir = sentence_transformers_copy(directory, tmp_path / "model", "mean")
    # 12 blocks of 4 tokens: a long-running request leaves too little for the embedding's
    # prompt, which is preempted after its first chunk and pooled again from its start.
    engine = tiny_engine(model_dir, runner="generate", num_kv_blocks=12, max_num_batched_tokens=8)
    long = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    engine.add_request("long", prompt(8, 7), long)
    while engine.requests["long"].num_tokens < 34:
        engine.step()
    ids = prompt(20, 8)
    request = engine.add_request("emb", ids, SamplingParams(), pooling=PoolingParams())
    tokens, embeddings = run(engine)
    assert request.num_preemptions > 0
    assert cosine(embeddings["emb"], reference_embedding(reference, ids, "mean")) > COSINE
    assert len(tokens["long"]) > 0


def test_embedding_requests_never_touch_the_prefix_cache(checkpoint):
    directory, _ = checkpoint
    engine = tiny_engine(directory)
    ids = prompt(24, 7)
    engine.add_request("emb", ids, SamplingParams(), pooling=PoolingParams())
    run(engine)
    assert engine.kv_cache.usage == 0
    assert engine.kv_events.last_sequence_number == 0  # no block was stored
    engine.add_request("gen", ids, GREEDY)
    engine.add_request("emb-again", ids, SamplingParams(), pooling=PoolingParams())
    run(engine)
    assert engine.requests == {}
    stats = engine.stats()
    assert stats.prefix_cache_hits == 0  # neither request found the embedding's blocks


def test_an_embedding_prompt_may_fill_the_context(checkpoint):
    directory, reference = checkpoint
    engine = tiny_engine(directory, max_model_len=32)
    ids = prompt(32, 8)
    engine.add_request("full", ids, SamplingParams(), pooling=PoolingParams())
    _, embeddings = run(engine)
    assert cosine(embeddings["full"], reference_embedding(reference, ids, "last")) > COSINE
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("over", prompt(33, 9), SamplingParams(), pooling=PoolingParams())
    with pytest.raises(InvalidRequestError, match="generated token"):
        engine.add_request("gen-full", ids, GREEDY)  # generation still needs room for one


def test_matryoshka_dimensions(checkpoint, tmp_path):
    directory, reference = checkpoint
    plain = tiny_engine(directory)
    with pytest.raises(InvalidRequestError, match="Matryoshka") as refused:
        plain.add_request("d", prompt(4, 1), SamplingParams(), pooling=PoolingParams(16))
    assert refused.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as refused:
        plain.add_request("d", prompt(4, 1), SamplingParams(), pooling=PoolingParams(0))
    assert refused.value.param == "dimensions"

    model_dir = tmp_path / "matryoshka"
    model_dir.mkdir()
    for file in directory.iterdir():
        if file.name != "config.json":
            (model_dir / file.name).symlink_to(file)
    config = json.loads((directory / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16, 32]}))
    engine = tiny_engine(model_dir)
    ids = prompt(9, 2)
    engine.add_request("cut", ids, SamplingParams(), pooling=PoolingParams(16))
    _, embeddings = run(engine)
    with torch.no_grad():
        hidden = reference.model(torch.tensor([ids])).last_hidden_state[0, -1, :16]
    assert len(embeddings["cut"]) == 16
    assert cosine(embeddings["cut"], hidden) > COSINE
    with pytest.raises(InvalidRequestError, match=r"one of \[16, 32\]") as refused:
        engine.add_request("bad", ids, SamplingParams(), pooling=PoolingParams(8))
    assert refused.value.param == "dimensions"


def test_the_simulated_engine_refuses_embedding_requests(default_model_dir):
    cost = StepCostModel(fixed_seconds=0.01, prefill_token_seconds=0.0, decode_sequence_seconds=0.0)
    engine = simulated_engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=16), cost)
    with pytest.raises(InvalidRequestError, match="embeddings") as refused:
        engine.add_request("e", prompt(4, 1), SamplingParams(), pooling=PoolingParams())
    assert refused.value.param == "pooling"
    assert engine.requests == {}


def test_the_offline_api_embeds(checkpoint, tmp_path, default_model_dir):
    directory, reference = checkpoint
    model_dir = sentence_transformers_copy(directory, tmp_path / "model", "cls")
    (model_dir / "tokenizer.json").symlink_to(default_model_dir / "tokenizer.json")
    with LLM(str(model_dir), dtype="float32", enforce_eager=True, num_kv_blocks=64) as llm:
        prompts = [prompt(7, 3), prompt(3, 4)]
        vectors = llm.embed(prompts)
        for ids, vector in zip(prompts, vectors, strict=True):
            assert cosine(vector, reference_embedding(reference, ids, "cls")) > COSINE
        (alone,) = llm.embed(prompts[0])  # one prompt's token ids
        assert alone == pytest.approx(vectors[0], abs=1e-5)


def test_pooling_with_tensor_parallel_ranks(checkpoint, tmp_path):
    """Two ranks (gloo): the plan's pooled entries reach the worker, rank 0 pools, chunked."""
    directory, reference = checkpoint
    model_dir = sentence_transformers_copy(directory, tmp_path / "model", "mean")
    engine = tiny_engine(model_dir, tensor_parallel_size=2)
    try:
        ids = prompt(40, 9)
        engine.add_request("tp", ids, SamplingParams(), pooling=PoolingParams())
        _, embeddings = run(engine)
    finally:
        engine.close()
    assert cosine(embeddings["tp"], reference_embedding(reference, ids, "mean")) > COSINE
