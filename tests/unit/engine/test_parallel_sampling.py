"""Parallel sampling (SamplingParams.n > 1) on a tiny float32 model: the prompt is computed once
and its KV blocks, the partial last one included, are shared by the samples copy-on-write;
each sample's tokens equal a request of its own with seed + i; n with a seed is reproducible;
aborts (one sample, or the whole request) free exactly what they should; a preempted sample
is recomputed and still matches; the offline API returns n results per prompt. The prefix
cache is off throughout, so any sharing seen here is the fork's, not the cache's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.config import EngineConfig
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.llm import LLM
from tiny_models import VARIANTS, make_checkpoint

BLOCK = 16
PROMPT_LEN = (
    100  # 6 full blocks and a partial 7th: the samples' first writes land in a shared block
)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
LONG = 40  # max_tokens of the reference runs; a shorter run's tokens are their first ones


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint(directory, *VARIANTS["llama"])
    return directory


def make_engine(directory, **overrides) -> LLMEngine:
    args = dict(
        model=str(directory),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=64,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    args.update(overrides)
    return LLMEngine(EngineConfig(**args))


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: LLMEngine, tokens: dict | None = None, finals: dict | None = None) -> dict:
    """Step to the end; tokens by (request id, sample index), last outputs into `finals`."""
    tokens = {} if tokens is None else tokens
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finished and finals is not None:
                finals[(out.request_id, out.index)] = out
    return tokens


def alone(directory, tokens: list[int], params: SamplingParams, **engine_args) -> list[int]:
    """The tokens of one n = 1 request on a fresh engine with nothing else running."""
    engine = make_engine(directory, **engine_args)
    engine.add_request("alone", tokens, params)
    return run(engine)[("alone", 0)]


def seed_runs(directory, tokens: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    """Sample i's expected tokens: a request of its own with seed + i."""
    return [
        alone(directory, tokens, dataclasses.replace(params, seed=params.seed + i))
        for i in range(n)
    ]


PROMPT = prompt(PROMPT_LEN, seed=1)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    """PROMPT's sample i for i < 4: LONG tokens of a request of its own with seed 11 + i."""
    return seed_runs(model_dir, PROMPT, dataclasses.replace(SEEDED, max_tokens=LONG), 4)


def assert_all_freed(engine: LLMEngine) -> None:
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.requests and not engine.has_unfinished


def test_fork_shares_every_prompt_block_and_copies_only_the_partial_one(model_dir):
    engine = make_engine(model_dir)
    kv = engine.kv_cache
    engine.add_request("x", PROMPT, dataclasses.replace(SEEDED, n=4))
    # A 64-token budget prefills the prompt in two chunks, once for all samples.
    assert engine.step() == []
    outputs = engine.step()
    assert sorted((o.request_id, o.index) for o in outputs) == [("x", i) for i in range(4)]

    samples = engine.scheduler.running
    assert [s.request_id for s in samples] == [f"x#{i}" for i in range(4)]
    prompt_blocks = -(-PROMPT_LEN // BLOCK)
    table = samples[0].block_table
    assert len(table) == prompt_blocks and all(s.block_table == table for s in samples)
    assert [kv.ref_count(b) for b in table] == [4] * prompt_blocks
    assert kv.num_blocks - kv.num_free_blocks == prompt_blocks

    # The first decode writes position 100, inside the shared last block: three samples get
    # a copy of it, the last holder writes in place; the full blocks stay shared by all four.
    engine.step()
    used = kv.num_blocks - kv.num_free_blocks
    assert used == prompt_blocks + 3
    assert used < 4 * prompt_blocks / 2  # far from n full copies of the prompt
    assert all(s.block_table[:-1] == table[:-1] for s in samples)
    assert len({s.block_table[-1] for s in samples}) == 4
    assert [kv.ref_count(b) for b in table[:-1]] == [4] * (prompt_blocks - 1)
    run(engine)
    assert_all_freed(engine)


@pytest.mark.parametrize("prompt_len", [PROMPT_LEN, 96])  # a partial last block, and none
def test_each_sample_equals_its_own_request_with_seed_plus_index(model_dir, expected, prompt_len):
    tokens = PROMPT[:prompt_len]
    engine = make_engine(model_dir)
    engine.add_request("x", tokens, dataclasses.replace(SEEDED, n=4))
    finals: dict = {}
    got = run(engine, finals=finals)
    alone_runs = (
        [e[:12] for e in expected]
        if prompt_len == PROMPT_LEN
        else seed_runs(model_dir, tokens, SEEDED, 4)
    )
    assert [got[("x", i)] for i in range(4)] == alone_runs
    for i in range(4):
        final = finals[("x", i)]
        assert final.finish_reason is FinishReason.LENGTH
        # Usage per sample: the prompt counts in full (once per request, as OpenAI counts it).
        assert (final.num_prompt_tokens, final.num_output_tokens) == (prompt_len, 12)
    assert_all_freed(engine)


def test_seeded_n4_is_reproducible_whatever_runs_beside_it_and_samples_differ(model_dir):
    params = dataclasses.replace(SEEDED, n=4)
    first = make_engine(model_dir)
    first.add_request("x", PROMPT, params)
    once = run(first)
    again = make_engine(model_dir)
    again.add_request("other", prompt(40, seed=3), SamplingParams(max_tokens=20, ignore_eos=True))
    again.add_request("x", PROMPT, params)
    twice = run(again)
    samples = [once[("x", i)] for i in range(4)]
    assert samples == [twice[("x", i)] for i in range(4)]
    assert len({tuple(s) for s in samples}) == 4


def test_greedy_samples_are_all_the_greedy_run(model_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = make_engine(model_dir)
    engine.add_request("x", PROMPT, dataclasses.replace(greedy, n=3))
    got = run(engine)
    assert [got[("x", i)] for i in range(3)] == [alone(model_dir, PROMPT, greedy)] * 3


def test_aborting_one_sample_frees_only_its_blocks_and_the_others_go_on(model_dir, expected):
    engine = make_engine(model_dir, max_num_batched_tokens=128)
    kv = engine.kv_cache
    engine.add_request("x", PROMPT, dataclasses.replace(SEEDED, n=4))
    got: dict = {}
    for _ in range(3):  # prefill and fork, then two decodes
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    victim = engine.requests["x#1"]
    own = [b for b in victim.block_table if kv.ref_count(b) == 1]
    shared = {b: kv.ref_count(b) for b in victim.block_table if kv.ref_count(b) > 1}
    free_before = kv.num_free_blocks

    [out] = engine.abort("x#1")
    assert (out.request_id, out.index, out.finished, out.finish_reason) == (
        "x",
        1,
        True,
        FinishReason.ABORT,
    )
    assert out.num_output_tokens == 3
    assert own and kv.num_free_blocks == free_before + len(own)
    assert {b: kv.ref_count(b) for b in shared} == {b: c - 1 for b, c in shared.items()}
    assert "x#1" not in engine.requests and "x" in engine.requests

    run(engine, got)
    assert got[("x", 1)] == expected[1][:3]
    assert [got[("x", i)] for i in (0, 2, 3)] == [expected[i][:12] for i in (0, 2, 3)]
    assert_all_freed(engine)
    assert engine.abort("x") == [] and engine.abort("x#0") == []


def test_aborting_the_request_aborts_every_sample_before_and_after_the_fork(model_dir):
    params = dataclasses.replace(SEEDED, n=3)
    for steps in (1, 3):  # mid-prefill (not forked yet), then forked and decoding
        engine = make_engine(model_dir)
        engine.add_request("x", PROMPT, params)
        for _ in range(steps):
            engine.step()
        outputs = engine.abort("x")
        assert [(o.request_id, o.index, o.finish_reason) for o in outputs] == [
            ("x", i, FinishReason.ABORT) for i in range(3)
        ]
        assert_all_freed(engine)


def test_a_sample_aborted_before_the_fork_is_left_out_of_it(model_dir, expected):
    engine = make_engine(model_dir)
    engine.add_request("x", PROMPT, dataclasses.replace(SEEDED, n=3))
    engine.step()  # the first prefill chunk
    [out] = engine.abort("x#0")
    assert (out.index, out.num_output_tokens) == (0, 0)
    got = run(engine)
    assert ("x", 0) not in got and [got[("x", 1)], got[("x", 2)]] == [e[:12] for e in expected[1:3]]
    assert_all_freed(engine)


def test_a_preempted_sample_is_recomputed_from_its_own_tokens(model_dir, expected):
    # 4 samples of 100 + 40 tokens need 6 shared blocks and 3 of their own each (18 blocks);
    # 14 blocks force preemptions, and a preempted sample comes back as prompt + its outputs.
    engine = make_engine(model_dir, num_kv_blocks=14, max_num_batched_tokens=160)
    engine.add_request("x", PROMPT, dataclasses.replace(SEEDED, max_tokens=LONG, n=4))
    got = run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [got[("x", i)] for i in range(4)] == expected
    assert_all_freed(engine)


def test_n_is_validated_and_sample_ids_cannot_collide(model_dir):
    engine = make_engine(model_dir, max_num_seqs=4)
    tokens = prompt(10)
    for n, match in (
        (0, r"n must be in \[1, 64\]"),
        (65, r"n must be in \[1, 64\]"),
        (True, "n must be an integer"),
        (5, "n is 5.*max_num_seqs"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request("x", tokens, dataclasses.replace(SEEDED, n=n))
    engine.add_request("a#1", tokens, SEEDED)
    with pytest.raises(InvalidRequestError, match="ids of its samples"):
        engine.add_request("a", tokens, dataclasses.replace(SEEDED, n=2))
    engine.add_request("b", tokens, dataclasses.replace(SEEDED, n=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("b#0", tokens, SEEDED)
    assert sorted(engine.requests) == ["a#1", "b", "b#0", "b#1"]
    run(engine)
    assert_all_freed(engine)


def test_offline_api_returns_n_results_per_prompt_in_order(default_model_dir):
    llm = LLM(
        str(default_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    seeded = SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True, n=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    results = llm.generate(["The sea is", "Colors:"], [seeded, greedy])
    assert [r.prompt for r in results] == ["The sea is"] * 3 + ["Colors:"]
    alone = [
        llm.generate("The sea is", dataclasses.replace(seeded, n=1, seed=4 + i))[0]
        for i in range(3)
    ]
    assert [r.token_ids for r in results[:3]] == [r.token_ids for r in alone]
    deltas = list(llm.generate_stream(["The sea is", "Colors:"], dataclasses.replace(greedy, n=2)))
    assert sorted(d.index for d in deltas if d.finished) == [0, 1, 2, 3]
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
