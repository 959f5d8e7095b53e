"""The sampling kernel: exact greedy argmax, the same token as a sort-based reference given the
same uniform noise for every mix of per-row parameters, and draws that follow the filtered
distribution."""

from __future__ import annotations

import torch
from kernel_utils import DEVICE

from engine.kernels.triton.sampling import sample, sample_ref, uniform_noise

VOCAB = 100  # over 32-wide tiles: the last one is partly masked


def params(rows: list[tuple[float, int, float, float]]) -> tuple[torch.Tensor, ...]:
    temperature, top_k, top_p, min_p = zip(*rows, strict=False)
    return (
        torch.tensor(temperature, dtype=torch.float32, device=DEVICE),
        torch.tensor(top_k, dtype=torch.int32, device=DEVICE),
        torch.tensor(top_p, dtype=torch.float32, device=DEVICE),
        torch.tensor(min_p, dtype=torch.float32, device=DEVICE),
    )


def test_greedy_is_exact_argmax_with_ties_to_the_lowest_id():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[1, 40] = logits[1, 77] = logits[1, 90] = 50.0
    logits[2] = float("-inf")
    logits[2, 99] = 0.0
    logits[3, 5] = logits[3, 64] = 1e9
    rows = [(0.0, 0, 1.0, 0.0)] * 4
    seeds = torch.arange(4, device=DEVICE)
    tokens = sample(logits.to(DEVICE), *params(rows), seeds, block_v=32)
    assert tokens.tolist() == logits.argmax(-1).tolist() == [int(logits[0].argmax()), 40, 99, 5]


def test_tokens_equal_the_reference_given_the_same_noise():
    generator = torch.Generator().manual_seed(1)
    # Coarse logits (multiples of 0.25) make ties at the top-k edge.
    logits = (torch.randn(10, VOCAB, generator=generator) * 8).round() / 4
    logits[9, :50] = float("-inf")  # banned tokens, as min_tokens or logit_bias leave them
    rows = [
        (0.0, 0, 1.0, 0.0),  # greedy among sampled rows
        (1.0, 0, 1.0, 0.0),  # plain sampling
        (0.7, 5, 1.0, 0.0),  # top-k
        (1.3, 0, 0.6, 0.0),  # top-p
        (1.0, 0, 1.0, 0.2),  # min-p
        (0.9, 12, 0.8, 0.05),  # all three
        (1.0, 1, 1.0, 0.0),  # top-k 1 is greedy
        (2.0, VOCAB, 0.999, 0.0),  # top-k >= vocab is off
        (0.5, 3, 0.3, 0.5),
        (1.0, 20, 0.9, 0.0),
    ]
    seeds = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18, 19, 2**40 + 3], device=DEVICE)
    for trial in range(3):
        seeds = seeds + 1000 * trial
        tokens = sample(logits.to(DEVICE), *params(rows), seeds, block_v=32)
        noise = uniform_noise(seeds, VOCAB, block_v=32)
        temperature, top_k, top_p, min_p = (list(c) for c in zip(*rows, strict=False))
        assert tokens.tolist() == sample_ref(logits, temperature, top_k, top_p, min_p, noise)


def test_noise_is_uniform_and_keyed_by_seed_only():
    seeds = torch.tensor([5, 6, 5], device=DEVICE)
    noise = uniform_noise(seeds, 4096).cpu()
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert noise.min() >= 0.0 and noise.max() < 1.0
    # Mean and the share under 0.25 within 5 standard errors of Uniform(0, 1).
    assert abs(noise[:2].mean() - 0.5) < 5 * (1 / 12 / 8192) ** 0.5
    assert abs((noise[:2] < 0.25).float().mean() - 0.25) < 5 * (0.25 * 0.75 / 8192) ** 0.5


def test_draws_follow_the_filtered_distribution():
    # Temperature and min-p only (no bisection): the interpreter runs 512 rows quickly; the
    # exact test above covers top-k and top-p given the noise.
    rows_count, vocab = 512, 8
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -9.0]]).expand(rows_count, vocab)
    rows = [(0.8, 0, 1.0, 0.1)] * rows_count
    tokens = sample(
        logits.contiguous().to(DEVICE),
        *params(rows),
        torch.arange(rows_count, device=DEVICE) * 7919,
    )
    # The filtered distribution the sampler promises, computed directly.
    probs = (logits[0] / 0.8).softmax(-1)
    probs[probs < 0.1 * probs.max()] = 0.0
    probs /= probs.sum()
    counts = torch.bincount(tokens.cpu(), minlength=vocab).float()
    assert counts[probs == 0].sum() == 0 and (probs == 0).sum() == 4
    expected = probs * rows_count
    # Each count within 5 binomial standard deviations.
    assert ((counts - expected).abs() <= 5 * (expected * (1 - probs)).sqrt() + 1).all()


def test_engine_sampler_on_the_kernel_keeps_seeds_batch_independent():
    """Sampler(use_kernel=True), the GPU path: greedy rows are argmax, seeded rows give the same
    tokens alone or in any batch, and every token is allowed by the row's filters."""
    from common.sampling_params import SamplingParams
    from engine.core.request import Request
    from engine.sampler import Sampler

    generator = torch.Generator().manual_seed(1)
    steps = [torch.randn(3, VOCAB, generator=generator) * 3 for _ in range(3)]
    seeded_params = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=5)

    def seeded_tokens(batched: bool) -> list[int]:
        sampler = Sampler(
            VOCAB, eos_token_ids=[0], device=DEVICE, seed=7 if batched else 8, use_kernel=True
        )
        seeded = Request("s", [1, 2, 3], seeded_params)
        greedy = Request("g", [1], SamplingParams(temperature=0.0))
        other = Request("o", [4], SamplingParams(temperature=1.0, min_p=0.1))
        tokens = []
        for logits in steps:
            batch = [greedy, other, seeded] if batched else [seeded]
            rows = logits if batched else logits[2:]
            out = sampler.sample(rows.to(DEVICE), batch).token_ids
            allowed = (sampler.processed_probs(rows.to(DEVICE), batch) > 0).cpu()
            assert all(allowed[i, t] for i, t in enumerate(out))
            if batched:
                assert out[0] == int(logits[0].argmax())
            for request, token in zip(batch, out, strict=False):
                request.append_output(token)
            tokens.append(out[-1])
        return tokens

    assert seeded_tokens(batched=False) == seeded_tokens(batched=True)
