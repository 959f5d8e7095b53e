"""The engine loop on tiny random-weight models: greedy tokens equal a transformers greedy
loop for every architecture, bad input is refused without disturbing anything, aborts free
memory, stop conditions, seeded sampling and logprobs."""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig, default_step_cost_path
from common.sampling_params import SamplingParams
from engine.core.step_cost import StepCostModel
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError, QueueFullError
from tiny_models import VARIANTS, hf_greedy, make_checkpoint

BLOCK = 4


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return directory, make_checkpoint(directory, *VARIANTS[request.param])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    return directory, make_checkpoint(directory, *VARIANTS["llama"])


def make_engine(directory, **overrides) -> LLMEngine:
    args = dict(
        model=str(directory),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    args.update(overrides)
    return LLMEngine(EngineConfig(**args))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def run(engine: LLMEngine, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    tokens = {} if tokens is None else tokens
    while engine.has_unfinished:
        step(engine, tokens)
    return tokens


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_greedy_tokens_equal_transformers_for_every_architecture(checkpoint):
    directory, reference = checkpoint
    engine = make_engine(directory)
    prompts = {"a": prompt(23, 1), "b": prompt(5, 2), "c": prompt(12, 3), "d": prompt(23, 1)[:17]}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    got = run(engine)
    for rid, ids in prompts.items():
        assert got[rid] == hf_greedy(reference, ids, 10), rid
    # "d" shares a's first blocks: chunked prefill (budget 16 < 23) and a prefix hit both happened.
    assert engine.kv_cache.prefix_cache_hits > 0
    assert engine.kv_cache.usage == 0 and not engine.requests


def test_an_engine_starts_from_the_step_cost_profile_folio_step_cost_names(
    llama, tmp_path, monkeypatch
):
    """`folio bench profile`'s model is what an engine's step costs start from (FOLIO_STEP_COST
    names the file, the cache's by default); where there is none, the built-in model."""
    profile = StepCostModel(0.003, 0.0003, 0.0004)
    profile.save(tmp_path / "step_cost.json")
    monkeypatch.setenv("FOLIO_STEP_COST", str(tmp_path / "step_cost.json"))
    assert make_engine(llama[0]).step_cost.model == profile
    monkeypatch.setenv("FOLIO_STEP_COST", str(tmp_path / "none.json"))
    built_in = make_engine(llama[0]).step_cost.model
    assert built_in == StepCostModel.load_or_default(tmp_path / "none.json") != profile
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FOLIO_STEP_COST")
    assert default_step_cost_path() == tmp_path / "step_cost.json"


def test_bad_input_is_refused_by_name_and_disturbs_nothing(llama):
    directory, _ = llama
    keep = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    clean = make_engine(directory)
    clean.add_request("keep", prompt(9, 4), keep)
    expected = run(clean)["keep"]

    engine = make_engine(directory, max_waiting_requests=2, max_model_len=64)
    engine.add_request("keep", prompt(9, 4), keep)
    tokens: dict[str, list[int]] = {}
    step(engine, tokens)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("keep", [1, 2], GREEDY)
    bad = [
        ("prompt_token_ids", prompt(64, 5), GREEDY),  # as long as the context
        ("prompt_token_ids", [], GREEDY),
        ("prompt_token_ids", [1, 2, 160], GREEDY),  # vocab is 160
        ("prompt_token_ids", [1, -1], GREEDY),
        ("max_tokens", [1, 2], SamplingParams(max_tokens=0)),
        ("max_tokens", [1, 2], SamplingParams(max_tokens=-3)),
        ("top_p", [1, 2], SamplingParams(top_p=0.0)),
        ("top_p", [1, 2], SamplingParams(top_p=1.5)),
        ("temperature", [1, 2], SamplingParams(temperature=-0.5)),
        ("temperature", [1, 2], SamplingParams(temperature=float("nan"))),
        ("stop_token_ids", [1, 2], SamplingParams(stop_token_ids=[999])),
        ("logit_bias", [1, 2], SamplingParams(logit_bias={500: 1.0})),
        ("logit_bias", [1, 2], SamplingParams(logit_bias={5: 1e308})),  # inf in float32
        ("repetition_penalty", [1, 2], SamplingParams(repetition_penalty=1e-300)),
        ("logprobs", [1, 2], SamplingParams(logprobs=21)),
    ]
    for i, (name, ids, params) in enumerate(bad):
        with pytest.raises(InvalidRequestError, match=name):
            engine.add_request(f"bad{i}", ids, params)
        step(engine, tokens)

    engine.add_request("w1", [1, 2, 3], GREEDY)
    engine.add_request("w2", [1, 2, 3], GREEDY)
    with pytest.raises(QueueFullError, match="max_waiting_requests"):
        engine.add_request("w3", [1, 2, 3], GREEDY)
    assert set(engine.requests) == {"keep", "w1", "w2"}

    got = run(engine, tokens)
    assert got["keep"] == expected
    assert len(got["w1"]) == len(got["w2"]) == 10
    assert engine.kv_cache.usage == 0 and not engine.requests


def test_abort_frees_blocks_and_keeps_others_running(llama):
    directory, _ = llama
    engine = make_engine(directory)
    engine.add_request("a", prompt(20, 6), GREEDY)
    engine.add_request("b", prompt(20, 7), GREEDY)
    for _ in range(3):
        engine.step()
    used = engine.kv_cache.usage
    assert engine.abort("a")
    assert engine.kv_cache.usage < used
    assert not engine.abort("a") and not engine.abort("never-seen")
    got = run(engine)
    assert "a" not in got or len(got["a"]) < 10
    assert engine.kv_cache.usage == 0 and not engine.requests


def test_stop_token_min_tokens_and_context_limit(llama):
    directory, reference = llama
    ids = prompt(8, 8)
    greedy = hf_greedy(reference, ids, 10)
    stop = greedy[3]
    first = greedy.index(stop)
    engine = make_engine(directory, max_model_len=8 + 6)
    engine.add_request(
        "stop", ids, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop])
    )
    engine.add_request("ctx", ids, GREEDY)
    finished = {}
    tokens = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason.value
    assert tokens["stop"] == greedy[: first + 1] and finished["stop"] == "stop"
    # The context (14 tokens) ends generation before max_tokens (10) does.
    assert len(tokens["ctx"]) == 6 and finished["ctx"] == "length"

    engine = make_engine(directory)
    engine.add_request(
        "min",
        ids,
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=first + 2, stop_token_ids=[stop]),
    )
    got = run(engine)["min"]
    assert stop not in got[: first + 2]


def test_seeded_sampling_ignores_the_rest_of_the_batch(llama):
    directory, _ = llama
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True
    )

    alone = make_engine(directory)
    alone.add_request("s", prompt(7, 9), params)
    expected = run(alone)["s"]

    crowded = make_engine(directory, seed=99)
    crowded.add_request(
        "x", prompt(13, 10), SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    )
    crowded.add_request(
        "y", prompt(3, 11), SamplingParams(temperature=1.2, max_tokens=5, ignore_eos=True)
    )
    crowded.add_request("s", prompt(7, 9), params)
    assert run(crowded)["s"] == expected

    other = make_engine(directory)
    other.add_request("s", prompt(7, 9), SamplingParams(**{**params.__dict__, "seed": 4321}))
    assert run(other)["s"] != expected


def test_logprobs_are_those_of_the_model(llama):
    directory, reference = llama
    ids = prompt(6, 12)
    engine = make_engine(directory)
    engine.add_request(
        "lp", ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    )
    records = []
    while engine.has_unfinished:
        for out in engine.step():
            records.extend(zip(out.new_token_ids, out.new_logprobs, strict=False))
    seq = list(ids)
    with torch.no_grad():
        for token, (chosen, top) in records:
            expected = torch.log_softmax(reference(torch.tensor([seq])).logits[0, -1].float(), -1)
            assert chosen == pytest.approx(expected[token].item(), abs=1e-4)
            values, indices = expected.topk(3)
            assert [t for t, _ in top] == indices.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
            seq.append(token)


def test_step_phases_are_timed(llama):
    directory, _ = llama
    engine = make_engine(directory)
    engine.add_request("t", prompt(9, 13), GREEDY)
    run(engine)
    t = engine.timings
    assert t.steps == 10
    assert t.forward > 0 and all(v >= 0 for v in t.as_dict().values())
    assert t.total == pytest.approx(sum(t.as_dict().values()))
