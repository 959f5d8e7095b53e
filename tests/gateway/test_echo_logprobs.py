"""Logprobs through the gateway against transformers, with the default model in float32 (its
own services, so the values are comparable to 1e-3): text completions with echo (the
loglikelihood request of lm-evaluation-harness: echo, logprobs=1, max_tokens=1, prompts as token
ids), max_tokens 0 scoring, streamed echo, and chat top_logprobs=20."""

from __future__ import annotations

import functools
import operator

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import EngineConfig
from common.tokenizer import Tokenizer
from gateway_helpers import GatewayThread
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService

TOLERANCE = 1e-3
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Water boils at a temperature of"]
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def client(default_model_dir):
    tokenizer = ServerThread(TokenizerService(str(default_model_dir), "127.0.0.1", 0))
    # Prefix caching stays on: prompt logprobs must not depend on it.
    engine = ServerThread(
        EngineService(
            EngineConfig(
                model=str(default_model_dir),
                dtype="float32",
                num_kv_blocks=256,
                max_model_len=512,
                max_num_seqs=8,
                max_num_batched_tokens=256,
            ),
            "127.0.0.1",
            0,
        )
    )
    gateway = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
    yield openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    )
    gateway.close()
    engine.close()
    tokenizer.close()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


def log_softmax(reference, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the distribution of the token after position p."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)


def text_of(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def check_completion_logprobs(
    logprobs, expected_ids: list[int], rows: torch.Tensor, tokenizer: Tokenizer, k: int
) -> None:
    """logprobs covers expected_ids (an echoed prompt, then what was generated); rows[p] is
    transformers' distribution of token p + 1."""
    assert logprobs.tokens == [text_of(tokenizer, t) for t in expected_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    for p, token_id in enumerate(expected_ids[1:]):
        assert logprobs.token_logprobs[p + 1] == pytest.approx(
            rows[p, token_id].item(), abs=TOLERANCE
        )
        values, indices = rows[p].topk(k)
        top = logprobs.top_logprobs[p + 1]
        assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=TOLERANCE)
        assert set(top) == {text_of(tokenizer, i) for i in indices.tolist()}


def test_echo_logprobs_of_token_id_prompts_equal_transformers(client, tokenizer, reference):
    """What lm-evaluation-harness's local-completions sends for loglikelihood."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    response = client.completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    for choice, ids in zip(sorted(response.choices, key=lambda c: c.index), prompts, strict=False):
        rows = log_softmax(reference, ids)
        generated = int(rows[-1].argmax())
        assert choice.text == tokenizer.decode(ids, skip_special_tokens=False) + text_of(
            tokenizer, generated
        )
        check_completion_logprobs(choice.logprobs, [*ids, generated], rows, tokenizer, 1)
    assert response.usage.prompt_tokens == sum(map(len, prompts))
    assert response.usage.completion_tokens == 2


def test_max_tokens_zero_scores_the_prompt(client, tokenizer, reference):
    prompt = PROMPTS[1]
    ids = tokenizer.encode(prompt)
    response = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=0
    )
    [choice] = response.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    check_completion_logprobs(choice.logprobs, ids, log_softmax(reference, ids), tokenizer, 3)
    assert response.usage.completion_tokens == 0

    # Without logprobs it is the prompt alone; without echo it is refused.
    response = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0)
    assert response.choices[0].text == prompt and response.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_streamed_echo_equals_the_whole_answer(client):
    params = dict(
        model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=2, max_tokens=4, temperature=0
    )
    whole = client.completions.create(**params).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **params) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith(PROMPTS[0])
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert (
        functools.reduce(operator.iadd, (lp.tokens for lp in streamed), []) == whole.logprobs.tokens
    )
    assert (
        functools.reduce(operator.iadd, (lp.token_logprobs for lp in streamed), [])
        == whole.logprobs.token_logprobs
    )
    assert (
        functools.reduce(operator.iadd, (lp.text_offset for lp in streamed), [])
        == whole.logprobs.text_offset
    )


def test_chat_top_logprobs_20_equal_transformers(client, tokenizer, reference):
    prompt = tokenizer.encode_chat(CHAT)
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, logprobs=True, top_logprobs=20, max_tokens=4, temperature=0
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    seq = list(prompt)
    for entry in content:
        row = log_softmax(reference, seq)[-1]
        token_id = int(row.argmax())
        assert entry.token == text_of(tokenizer, token_id)
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=TOLERANCE)
        values, indices = row.topk(20)
        assert len(entry.top_logprobs) == 20
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            values.tolist(), abs=TOLERANCE
        )
        # Order by text only where transformers' values are not within the tolerance of a
        # neighbour (near-ties may swap).
        ranked = values.tolist()
        for i, (top, ref_id) in enumerate(zip(entry.top_logprobs, indices.tolist(), strict=False)):
            neighbours = [ranked[j] for j in (i - 1, i + 1) if 0 <= j < 20]
            if all(abs(ranked[i] - v) > 2 * TOLERANCE for v in neighbours):
                assert top.token == text_of(tokenizer, ref_id)
        seq.append(token_id)
