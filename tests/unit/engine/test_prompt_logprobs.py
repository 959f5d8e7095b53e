"""Prompt logprobs in the engine, on a tiny random float32 model: each prompt token's logprob
and top-k equal log_softmax of transformers' logits, whole or chunked prefill, with the prompt's
prefix already in the prefix cache, after a preemption in the middle of the prefill, and in a
batch whose ordinary requests keep their exact tokens; max_tokens 0 scores without generating."""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from tiny_models import VARIANTS, hf_greedy, make_checkpoint

TOLERANCE = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-prompt-logprobs")
    return directory, make_checkpoint(directory, *VARIANTS["llama"])


def tiny_engine(directory, **overrides) -> LLMEngine:
    args = dict(
        model=str(directory),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    return LLMEngine(EngineConfig(**{**args, **overrides}))


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logprobs(reference, ids: list[int], k: int) -> list[tuple[int, float, list]]:
    """(token id, logprob, top k) for prompt tokens 1.. from transformers' float32 logits."""
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
    out = []
    for t in range(1, len(ids)):
        values, indices = logprobs[t - 1].topk(k)
        out.append(
            (
                ids[t],
                logprobs[t - 1, ids[t]].item(),
                list(zip(indices.tolist(), values.tolist(), strict=False)),
            )
        )
    return out


def assert_matches(got, expected) -> None:
    assert got is not None and len(got) == len(expected)
    for (token, logprob, top), (ref_token, ref_logprob, ref_top) in zip(
        got, expected, strict=False
    ):
        assert token == ref_token
        assert logprob == pytest.approx(ref_logprob, abs=TOLERANCE)
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=TOLERANCE)


def run(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Every request to its end: tokens by request, and the prompt logprobs each output carried."""
    tokens: dict[str, list[int]] = {}
    prompt_logprobs: dict[str, list] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                assert out.request_id not in prompt_logprobs, "prompt logprobs came twice"
                prompt_logprobs[out.request_id] = out.prompt_logprobs
    return tokens, prompt_logprobs


@pytest.mark.parametrize("budget", [64, 5], ids=["whole-prefill", "chunked-prefill"])
def test_prompt_logprobs_equal_transformers_in_a_mixed_batch(llama, budget):
    directory, reference = llama
    engine = tiny_engine(directory, max_num_batched_tokens=budget)
    prompts = {
        "p3": random_prompt(23, 1),
        "plain": random_prompt(9, 2),
        "p0": random_prompt(13, 3),
        "plain-logprobs": random_prompt(7, 4),
        "p-one-token": random_prompt(1, 5),
    }
    params = {
        "p3": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=3),
        "plain": GREEDY,
        "p0": SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=2
        ),
        "plain-logprobs": SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2
        ),
        "p-one-token": SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=5
        ),
    }
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params[rid])
    tokens, prompt_logprobs = run(engine)

    for rid, ids in prompts.items():
        assert tokens[rid] == hf_greedy(reference, ids, 6), rid
    assert set(prompt_logprobs) == {"p3", "p0", "p-one-token"}
    assert_matches(prompt_logprobs["p3"], reference_logprobs(reference, prompts["p3"], 3))
    assert_matches(prompt_logprobs["p0"], reference_logprobs(reference, prompts["p0"], 0))
    assert prompt_logprobs["p-one-token"] == []
    assert engine.kv_cache.usage == 0 and not engine.requests


def test_a_cached_prefix_does_not_skip_prompt_tokens(llama):
    directory, reference = llama
    engine = tiny_engine(directory)
    shared = random_prompt(20, 6)
    engine.add_request("warm", [*shared, 7], GREEDY)
    run(engine)
    asked = [*shared, 8, 9]
    request = engine.add_request(
        "asked",
        asked,
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2),
    )
    _, prompt_logprobs = run(engine)
    assert request.num_cached_tokens == 0
    assert_matches(prompt_logprobs["asked"], reference_logprobs(reference, asked, 2))
    # The blocks it computed are cached for the requests that do not ask.
    after = engine.add_request("after", asked, GREEDY)
    run(engine)
    assert after.num_cached_tokens == 20


def test_preemption_in_the_middle_of_the_prefill(llama):
    directory, reference = llama
    # 12 blocks of 4 tokens: a long-running request leaves too little for the second's prompt.
    engine = tiny_engine(directory, num_kv_blocks=12, max_num_batched_tokens=8)
    engine.add_request(
        "long", random_prompt(8, 7), SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    )
    while engine.requests["long"].num_tokens < 34:
        engine.step()
    ids = random_prompt(20, 8)
    request = engine.add_request(
        "asked",
        ids,
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=4),
    )
    partial_when_preempted = None
    got = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got = out.prompt_logprobs
        if request.num_preemptions and partial_when_preempted is None:
            partial_when_preempted = len(request.prompt_logprobs)
    assert got is not None and 0 < partial_when_preempted < len(ids) - 1
    assert_matches(got, reference_logprobs(reference, ids, 4))


def test_max_tokens_zero_scores_the_prompt_without_generating(llama):
    directory, reference = llama
    engine = tiny_engine(directory, max_num_batched_tokens=6)
    ids = random_prompt(15, 9)
    engine.add_request("scored", ids, SamplingParams(max_tokens=0, prompt_logprobs=1))
    engine.add_request(
        "generated", ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    finish_reasons = {}
    tokens: dict[str, list[int]] = {}
    prompt_logprobs = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                prompt_logprobs[out.request_id] = out.prompt_logprobs
            if out.finished:
                finish_reasons[out.request_id] = (out.finish_reason.value, out.num_output_tokens)
    assert tokens["scored"] == [] and finish_reasons["scored"] == ("length", 0)
    assert_matches(prompt_logprobs["scored"], reference_logprobs(reference, ids, 1))
    assert tokens["generated"] == hf_greedy(reference, ids, 2)
    assert set(prompt_logprobs) == {"scored"}

    for params, name in [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    ]:
        with pytest.raises(InvalidRequestError, match=name):
            engine.add_request("bad", ids, params)


def test_each_of_n_samples_carries_the_prompt_logprobs(llama):
    directory, reference = llama
    engine = tiny_engine(directory, max_num_batched_tokens=8)
    ids = random_prompt(18, 10)
    engine.add_request(
        "n2",
        ids,
        SamplingParams(
            n=2, temperature=1.0, seed=3, max_tokens=3, ignore_eos=True, prompt_logprobs=2
        ),
    )
    by_index = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.index not in by_index, "prompt logprobs came twice"
                by_index[out.index] = out.prompt_logprobs
    expected = reference_logprobs(reference, ids, 2)
    assert set(by_index) == {0, 1}
    for got in by_index.values():
        assert_matches(got, expected)
