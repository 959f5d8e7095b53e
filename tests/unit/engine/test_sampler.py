"""Sampler tests against a plain per-row Python/numpy reference of the documented semantics."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from common.sampling_params import SamplingParams
from engine import sampler as sampler_module
from engine.core.outputs import NO_TOKEN
from engine.core.request import Request
from engine.sampler import Sampler, SamplingRow, row_argmax

EOS = [0, 7]


def make_request(params: SamplingParams, prompt=(1, 2, 3), output=(), request_id="r") -> Request:
    params.validate()
    request = Request(request_id, list(prompt), params)
    for token in output:
        request.append_output(token)
    return request


def _softmax_over(logits: np.ndarray, keep: np.ndarray) -> np.ndarray:
    shifted = np.where(keep, logits - logits[keep].max(), -np.inf)
    weights = np.exp(shifted)
    return weights / weights.sum()


def reference_probs(row, request: Request, vocab_size: int, eos=EOS) -> np.ndarray:
    """The distribution a row is drawn from, one token at a time, in float64."""
    p = request.sampling_params
    logits = np.array(row[:vocab_size], dtype=np.float64)
    if p.allowed_token_ids is not None:
        outside = np.ones(vocab_size, dtype=bool)
        outside[p.allowed_token_ids] = False
        logits[outside] = -np.inf
    for token, bias in (p.logit_bias or {}).items():
        logits[token] += bias
    if len(request.output_token_ids) < p.min_tokens:
        for token in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)):
            logits[token] = -np.inf
    output = list(request.output_token_ids)
    for *before, last in p.bad_words_token_ids:
        if not before or output[len(output) - len(before) :] == before:
            logits[last] = -np.inf
    if p.repetition_penalty != 1.0:
        for token in set(request.prompt_token_ids) | set(request.output_token_ids):
            if logits[token] > 0:
                logits[token] /= p.repetition_penalty
            else:
                logits[token] *= p.repetition_penalty
    for token, count in Counter(request.output_token_ids).items():
        logits[token] -= p.presence_penalty + p.frequency_penalty * count
    if p.temperature == 0:
        one_hot = np.zeros(vocab_size)
        one_hot[int(np.argmax(logits))] = 1.0
        return one_hot

    logits = logits / p.temperature
    keep = np.isfinite(logits)
    if 0 < p.top_k < vocab_size:
        kth = sorted(logits, reverse=True)[p.top_k - 1]
        keep &= logits >= kth
    if p.top_p < 1.0:
        probs = _softmax_over(logits, keep)
        mass, nucleus = 0.0, []
        for token in sorted(range(vocab_size), key=lambda t: -probs[t]):
            if mass >= p.top_p:
                break
            nucleus.append(token)
            mass += probs[token]
        keep &= probs >= probs[nucleus[-1]]
    if p.min_p > 0:
        probs = _softmax_over(logits, keep)
        keep &= probs >= p.min_p * probs.max()
    return _softmax_over(logits, keep)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def assert_matches_reference(sampler: Sampler, logits: torch.Tensor, requests: list[Request]):
    probs = sampler.processed_probs(logits, requests)
    assert probs.shape == (len(requests), sampler.vocab_size)
    for i, request in enumerate(requests):
        expected = reference_probs(logits[i].tolist(), request, sampler.vocab_size)
        np.testing.assert_allclose(
            probs[i].numpy(), expected, rtol=0, atol=1e-6, err_msg=f"row {i}"
        )
    return probs


# --- greedy -----------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_like_torch():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 0.5],
            [4.0, 4.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [-2.0, -1.0, -3.0, -1.0, -5.0, -1.0, -1.0, -4.0],
        ]
    )
    sampler = Sampler(8, EOS)
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(3)]
    out = sampler.sample(logits, requests)
    assert out.token_ids == logits.argmax(-1).tolist() == [1, 0, 1]
    assert out.token_ids == [int(np.argmax(row)) for row in logits.numpy()]
    assert out.logprobs == [None, None, None]


def test_greedy_with_penalties_bias_and_min_tokens_follows_reference():
    vocab = 64
    logits = random_logits(6, vocab, seed=1)
    # Make the raw argmax a token that each row's processing must push down.
    logits[:, 5] = 20.0
    logits[:, 0] = 25.0
    configs = [
        (SamplingParams(temperature=0.0, repetition_penalty=3.0), (5, 9), (0,)),
        (
            SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
            (1,),
            (0, 0, 0, 5, 5, 5),
        ),
        (SamplingParams(temperature=0.0, logit_bias={0: -100.0, 5: -100.0, 11: 50.0}), (1,), ()),
        (SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8), (1,), (4,)),
        (SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, ignore_eos=True), (1,), (4,)),
        (SamplingParams(temperature=0.0), (1,), ()),
    ]
    requests = [make_request(p, prompt, output) for p, prompt, output in configs]
    sampler = Sampler(vocab, EOS)
    out = sampler.sample(logits, requests)
    expected = [
        int(np.argmax(reference_probs(logits[i].tolist(), r, vocab)))
        for i, r in enumerate(requests)
    ]
    assert out.token_ids == expected
    assert out.token_ids[2] == 11  # the bias winner
    assert out.token_ids[3] == 5  # EOS 0 masked by min_tokens
    assert out.token_ids[4] == 0  # ignore_eos: EOS stays allowed
    assert out.token_ids[5] == 0
    assert_matches_reference(sampler, logits, requests)


def test_all_greedy_fast_path_ignores_padding_columns():
    vocab = 100
    logits = random_logits(16, vocab + 28, seed=2)
    logits[:, vocab:] = 1e4  # padding columns must never win
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(16)]
    out = Sampler(vocab, EOS).sample(logits, requests)
    assert out.token_ids == logits[:, :vocab].argmax(-1).tolist()


def test_row_argmax_is_torchs_argmax_with_ties_nan_and_infinities():
    """The numpy argmax the CPU sampler takes: the first of tied maxima, NaN as the largest,
    a row of -inf at 0, on strided views (a padded vocabulary's columns cut off) too."""
    values = random_logits(6, 130, seed=4)
    values[0, [3, 70]] = 50.0  # a tie
    values[1] = -math.inf
    values[2, [5, 9]] = math.nan
    values[3, [8, 90]] = math.inf
    values[4] = values[4].round()  # many ties
    for rows in (values, values[:, :100], values[1:4]):
        assert row_argmax(rows).tolist() == rows.argmax(-1).tolist()


# --- filtering distributions ------------------------------------------------------------

FILTER_CONFIGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.4),
    SamplingParams(temperature=2.5),
    SamplingParams(top_k=1),
    SamplingParams(top_k=7),
    SamplingParams(top_k=150),
    SamplingParams(top_p=0.2),
    SamplingParams(top_p=0.75),
    SamplingParams(top_p=0.97),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.3),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.1),
    SamplingParams(temperature=0.0, top_k=5, top_p=0.5),
    SamplingParams(temperature=1.5, top_k=3, min_p=0.5),
]


def test_filters_alone_and_combined_match_reference():
    vocab = 200
    logits = random_logits(len(FILTER_CONFIGS), vocab, seed=3)
    requests = [make_request(p) for p in FILTER_CONFIGS]
    sampler = Sampler(vocab, EOS)
    probs = assert_matches_reference(sampler, logits, requests)
    # Each row on its own gives the same distribution as inside the mixed batch.
    for i, request in enumerate(requests):
        alone = sampler.processed_probs(logits[i : i + 1], [request])
        torch.testing.assert_close(alone[0], probs[i], rtol=0, atol=1e-7)


def test_sampled_tokens_stay_inside_the_allowed_set():
    vocab, repeats = 200, 64
    base = random_logits(len(FILTER_CONFIGS), vocab, seed=4)
    logits = base.repeat_interleave(repeats, dim=0)
    requests = [make_request(p) for p in FILTER_CONFIGS for _ in range(repeats)]
    sampler = Sampler(vocab, EOS, seed=5)
    for _ in range(3):
        tokens = sampler.sample(logits, requests).token_ids
        for i, (token, request) in enumerate(zip(tokens, requests, strict=False)):
            allowed = reference_probs(base[i // repeats].tolist(), request, vocab) > 0
            assert allowed[token], (i, request.sampling_params, token)


def test_top_k_keeps_ties_at_the_edge():
    logits = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0, 0.0]])
    request = make_request(SamplingParams(top_k=2))
    probs = assert_matches_reference(Sampler(6, EOS), logits, [request])
    assert (probs[0] > 0).tolist() == [True, True, True, True, False, False]


def test_wide_top_p_nucleus_matches_reference():
    # Nearly flat rows: the nucleus spans thousands of tokens.
    vocab = 4096
    logits = random_logits(4, vocab, seed=6, scale=0.2)
    logits[1] = random_logits(1, vocab, seed=7, scale=4.0)  # a peaked row in the same batch
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.9),
        SamplingParams(),
        SamplingParams(top_p=0.5, top_k=3000),
    ]
    requests = [make_request(p) for p in params]
    probs = assert_matches_reference(Sampler(vocab, EOS), logits, requests)
    assert (probs[0] > 0).sum() > 2048


def test_nuclei_found_among_the_largest_candidates_match_reference(monkeypatch):
    """Peaked rows of a large vocabulary, dense ones (top-p alone) and ones top-k and min-p left
    mostly zeros: top-p finds every nucleus among the rows' largest NUCLEUS_CANDIDATES values
    (no row sorted whole), with the reference's distributions."""
    vocab = 8192
    logits = random_logits(4, vocab, seed=21, scale=5.0)
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(temperature=0.7, top_p=0.95),
        SamplingParams(top_k=600, top_p=0.8),
        SamplingParams(top_p=0.9, min_p=0.001),
    ]
    counts = []
    largest_first = sampler_module._largest_first

    def spy(values, count):
        counts.append(count)
        return largest_first(values, count)

    monkeypatch.setattr(sampler_module, "_largest_first", spy)
    requests = [make_request(p) for p in params]
    assert_matches_reference(Sampler(vocab, EOS), logits, requests)
    assert counts == [sampler_module.NUCLEUS_CANDIDATES]


# --- penalties, bias, min_tokens --------------------------------------------------------


def test_penalties_and_bias_match_reference():
    vocab = 50
    configs = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=0.8),
        SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.0),
        SamplingParams(logit_bias={3: 5.0, 4: -7.5, 49: 2.0}),
        SamplingParams(
            temperature=0.9,
            top_p=0.8,
            repetition_penalty=1.2,
            presence_penalty=0.4,
            frequency_penalty=0.3,
            logit_bias={10: 1.0},
        ),
        SamplingParams(),
    ]
    prompt, output = (3, 4, 4, 10, 20, 21), (10, 10, 10, 22, 23, 4)
    requests = [make_request(p, prompt, output) for p in configs]
    logits = random_logits(len(configs), vocab, seed=8)
    probs = assert_matches_reference(Sampler(vocab, EOS), logits, requests)
    # Sanity that the penalties did something: the penalized rows differ from the plain one.
    plain = torch.softmax(logits, -1)
    for i in range(len(configs) - 1):
        assert not torch.allclose(probs[i], plain[i], atol=1e-4)
    torch.testing.assert_close(probs[-1], plain[-1])


def test_min_tokens_masks_eos_and_stop_tokens():
    vocab = 16
    logits = torch.zeros(4, vocab)
    configs = [
        (SamplingParams(min_tokens=2, max_tokens=5, stop_token_ids=[3]), (9,)),
        (SamplingParams(min_tokens=2, max_tokens=5, stop_token_ids=[3], ignore_eos=True), (9,)),
        (SamplingParams(min_tokens=2, max_tokens=5, stop_token_ids=[3]), (9, 9)),
        (SamplingParams(stop_token_ids=[3]), ()),
    ]
    requests = [make_request(p, output=o) for p, o in configs]
    probs = assert_matches_reference(Sampler(vocab, EOS), logits, requests)
    zero = probs == 0
    assert zero[0, [0, 3, 7]].all() and zero[0].sum() == 3
    assert zero[1, 3] and zero[1].sum() == 1
    assert not zero[2].any() and not zero[3].any()


def test_allowed_token_ids_and_bad_words_follow_reference():
    vocab = 16
    logits = random_logits(6, vocab, seed=5)
    allowed = [2, 5, 6, 11]
    words = [[4], [8, 9], [1, 8, 12]]
    configs = [
        (SamplingParams(temperature=0.0, allowed_token_ids=allowed), ()),
        (SamplingParams(temperature=0.9, allowed_token_ids=allowed, logit_bias={5: 3.0}), ()),
        # Greedy: each banned token made the argmax first, so a ban that did not apply shows.
        (SamplingParams(temperature=0.0, bad_words_token_ids=words), (3, 8)),
        (SamplingParams(temperature=0.7, top_k=5, bad_words_token_ids=words), (1, 8)),
        (SamplingParams(min_tokens=3, max_tokens=9, bad_words_token_ids=words), (8,)),
        (SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 3]], allowed_token_ids=[3]), ()),
    ]
    logits[2, 9] = logits[3, 12] = logits[4, 9] = 50.0
    requests = [make_request(p, output=o) for p, o in configs]
    probs = assert_matches_reference(Sampler(vocab, EOS), logits, requests)
    outside = [t for t in range(vocab) if t not in allowed]
    assert (probs[:2, outside] == 0).all() and (probs[:2, allowed].sum(-1) > 0.999).all()
    assert (probs[2:5, 4] == 0).all()  # a one-token bad word: everywhere
    assert probs[2, 9] == 0 and probs[4, 9] == 0  # [8, 9] after an 8
    assert probs[3, 12] == 0 and probs[3, 9] == 0  # [1, 8, 12] after 1, 8
    assert probs[5, 3] == 1  # [3, 3] bans 3 only after a 3


def test_a_row_its_limits_leave_no_token_samples_no_token():
    vocab = 16
    logits = random_logits(4, vocab, seed=8)
    grammar = torch.zeros(4, vocab, dtype=torch.bool)
    grammar[:, 5] = True  # each row's grammar forbids token 5
    configs = [
        SamplingParams(temperature=0.0, allowed_token_ids=[5]),  # only what the grammar forbids
        SamplingParams(temperature=0.9, seed=2, allowed_token_ids=[5]),
        SamplingParams(temperature=0.0, allowed_token_ids=[5, 6], bad_words_token_ids=[[6]]),
        SamplingParams(temperature=0.0, allowed_token_ids=[5, 6]),  # 6 is left
    ]
    requests = [make_request(p, request_id=f"r{i}") for i, p in enumerate(configs)]
    out = Sampler(vocab, EOS).sample(logits, requests, grammar)
    assert out.token_ids == [NO_TOKEN, NO_TOKEN, NO_TOKEN, 6]


def test_caller_logits_are_not_modified():
    vocab = 50
    logits = random_logits(3, vocab, seed=9)
    before = logits.clone()
    requests = [
        make_request(
            SamplingParams(repetition_penalty=1.5, logit_bias={1: 3.0}, top_p=0.5), output=(1, 2)
        ),
        make_request(SamplingParams(temperature=0.5, top_k=3, min_p=0.1)),
        make_request(SamplingParams(temperature=0.0, frequency_penalty=1.0), output=(4,)),
    ]
    sampler = Sampler(vocab, EOS)
    sampler.sample(logits, requests)
    sampler.processed_probs(logits, requests)
    assert torch.equal(logits, before)


# --- seeds ------------------------------------------------------------------------------


def run_target(position: int, companions: list[SamplingParams], sampler_seed: int, steps: int = 8):
    """Tokens of a seeded request over several steps, placed at `position` among companions."""
    vocab = 500
    step_logits = random_logits(steps, vocab, seed=10, scale=1.5)
    target = make_request(SamplingParams(seed=1234, temperature=0.9, top_p=0.95), request_id="t")
    others = [make_request(p, output=(5,), request_id=f"c{j}") for j, p in enumerate(companions)]
    sampler = Sampler(vocab, EOS, seed=sampler_seed)
    noise = torch.Generator().manual_seed(sampler_seed + 100)
    for step in range(steps):
        batch = [*others[:position], target, *others[position:]]
        logits = torch.randn(len(batch), vocab, generator=noise) * 3
        logits[position] = step_logits[step]
        tokens = sampler.sample(logits, batch).token_ids
        for request, token in zip(batch, tokens, strict=False):
            request.append_output(token)
    return target.output_token_ids


def test_seeded_request_is_independent_of_its_batch():
    alone = run_target(0, [], sampler_seed=0)
    assert len(set(alone)) > 1
    scenarios = [
        (0, [SamplingParams()] * 7, 1),
        # Companions with the target's own seed, on other logits.
        (3, [SamplingParams(seed=1234, temperature=0.9, top_p=0.95)] * 7, 2),
        (7, [SamplingParams(temperature=0.0, repetition_penalty=1.2)] * 7, 3),
        (
            4,
            [
                SamplingParams(top_k=5),
                SamplingParams(seed=7),
                SamplingParams(temperature=0.0),
                SamplingParams(min_p=0.2, presence_penalty=1.0),
                SamplingParams(top_p=0.3, logprobs=2),
                SamplingParams(min_tokens=2, max_tokens=20),
            ],
            4,
        ),
        (1, [SamplingParams(temperature=0.0)], 5),
    ]
    for position, companions, sampler_seed in scenarios:
        assert run_target(position, companions, sampler_seed) == alone, (position, companions)


def test_different_seeds_differ_and_unseeded_rows_vary_across_steps():
    vocab, steps = 1000, 8
    logits = torch.zeros(3, vocab)
    requests = [
        make_request(SamplingParams(seed=1)),
        make_request(SamplingParams(seed=2)),
        make_request(SamplingParams()),
    ]
    sampler = Sampler(vocab, EOS)
    history = [sampler.sample(logits, requests).token_ids for _ in range(steps)]
    seed1, seed2, unseeded = zip(*history, strict=False)
    assert seed1 != seed2
    assert len(set(unseeded)) > 1
    # The same seed replays the same tokens.
    replay = make_request(SamplingParams(seed=1))
    assert [sampler.sample(logits[:1], [replay]).token_ids[0] for _ in range(steps)] == list(seed1)


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(4, 1000)

    def run(seed: int) -> list[list[int]]:
        sampler = Sampler(1000, EOS, seed=seed)
        requests = [make_request(SamplingParams()) for _ in range(4)]
        return [sampler.sample(logits, requests).token_ids for _ in range(3)]

    torch.manual_seed(0)
    first = run(21)
    torch.manual_seed(1)  # the global RNG plays no part
    assert run(21) == first
    assert run(22) != first


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits():
    vocab = 120
    logits = random_logits(5, vocab + 8, seed=11)
    logits[:, vocab:] = 50.0  # padding columns are not part of the distribution
    configs = [
        SamplingParams(logprobs=3, temperature=0.0, repetition_penalty=2.0, logit_bias={7: 30.0}),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0.5, top_k=4),
        SamplingParams(logprobs=20, top_p=0.6, presence_penalty=2.0),
        SamplingParams(logprobs=1, seed=3, frequency_penalty=-2.0),
    ]
    requests = [make_request(p, prompt=(7, 8), output=(9, 9)) for p in configs]
    out = Sampler(vocab, EOS).sample(logits, requests)
    expected = torch.log_softmax(logits[:, :vocab].double(), -1).numpy()
    assert out.logprobs[1] is None
    for i, params in enumerate(configs):
        if params.logprobs is None:
            continue
        chosen, top = out.logprobs[i]
        assert chosen == pytest.approx(expected[i, out.token_ids[i]], abs=1e-5)
        assert len(top) == params.logprobs
        reference_top = np.sort(expected[i])[::-1][: params.logprobs]
        np.testing.assert_allclose([lp for _, lp in top], reference_top, atol=1e-5)
        for token, lp in top:
            assert 0 <= token < vocab and lp == pytest.approx(expected[i, token], abs=1e-5)
    # The greedy row picked the bias winner, yet its logprob is the raw one.
    assert out.token_ids[0] == 7


# --- statistics -------------------------------------------------------------------------


def assert_frequencies_follow(tokens: list[int], expected: np.ndarray):
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(expected)) / n
    assert counts[expected == 0].sum() == 0
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts - expected) <= 5 * sigma + 2e-3), (counts, expected)


PEAKED = [math.log(0.6), math.log(0.3), math.log(0.1)] + [-3.0] * 27


@pytest.mark.parametrize(
    "base, params",
    [
        (
            random_logits(1, 30, seed=12, scale=1.5),
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
        ),
        (torch.tensor([PEAKED]), SamplingParams(top_k=3)),
    ],
)
def test_sampling_frequencies_follow_the_filtered_distribution(base, params):
    vocab = base.shape[1]
    expected = reference_probs(base[0].tolist(), make_request(params), vocab)
    assert (expected > 0).sum() >= 3

    # Unseeded rows: one batch of many identical rows.
    rows = 4000
    requests = [make_request(SamplingParams(**vars(params))) for _ in range(rows)]
    tokens = Sampler(vocab, EOS, seed=13).sample(base.expand(rows, vocab), requests).token_ids
    assert_frequencies_follow(tokens, expected)

    # One seeded request over many steps.
    seeded = make_request(SamplingParams(**{**vars(params), "seed": 14}))
    sampler = Sampler(vocab, EOS)
    tokens = [sampler.sample(base, [seeded]).token_ids[0] for _ in range(2000)]
    assert_frequencies_follow(tokens, expected)


def test_draws_follow_the_distribution_across_the_draws_chunks():
    """Inverse transform sampling sums a row a chunk at a time: over a vocabulary of several
    chunks and a padded last one, tokens at the chunks' first and last places and tokens
    alone in their chunk are drawn as often as their probability says, and a token of
    probability 0 never, wherever it lies; unseeded rows and a seeded request alike."""
    chunk = sampler_module.DRAW_CHUNK
    vocab = 3 * chunk + 100
    probs = np.zeros(vocab)
    for token, p in [(0, 0.1), (chunk - 1, 0.2), (chunk, 0.15), (2 * chunk + 7, 0.05)]:
        probs[token] = p
    probs[3 * chunk : 3 * chunk + 40] = 0.5 / 40  # the padded chunk's tokens
    logits = torch.tensor([np.log(np.where(probs > 0, probs, 1e-300))], dtype=torch.float32)
    logits[0, probs == 0] = -math.inf
    params = SamplingParams(temperature=1.0)
    rows = 6000
    requests = [make_request(SamplingParams(**vars(params))) for _ in range(rows)]
    tokens = Sampler(vocab, EOS, seed=3).sample(logits.expand(rows, vocab), requests).token_ids
    assert_frequencies_follow(tokens, probs)
    seeded = make_request(SamplingParams(temperature=1.0, seed=8))
    sampler = Sampler(vocab, EOS)
    assert_frequencies_follow(
        [sampler.sample(logits, [seeded]).token_ids[0] for _ in range(3000)], probs
    )


def test_rows_are_built_when_a_request_joins_not_every_step(monkeypatch):
    vocab = 16
    sampler = Sampler(vocab, EOS)
    params = SamplingParams(temperature=0.8, top_k=5, min_tokens=3, logit_bias={4: -100.0})
    request = make_request(params, request_id="joined")
    sampler.join(request)  # n = 1: its own row
    parent = make_request(SamplingParams(temperature=0.0, n=2, seed=1), request_id="parent")
    sampler.join(parent)  # n > 1: the samples' rows are built with the parent's

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a sampling row was rebuilt after join")

    monkeypatch.setattr(SamplingRow, "build", no_rebuild)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    for _ in range(params.min_tokens):
        tokens = sampler.sample(logits, [request, *parent.samples]).token_ids
        assert tokens[0] not in (4, *EOS)  # bias and min_tokens come from the joined row
        assert tokens[1:] == [int(logits[1].argmax()), int(logits[2].argmax())]
        request.append_output(tokens[0])
    sampler.leave(request)
    with pytest.raises(AssertionError, match="rebuilt"):
        sampler.sample(logits[:1], [request])  # a request that left joins again if sampled
