"""The fused MoE kernel (grouped GEMMs over pairs sorted by expert) against the plain loop over
experts, under the Triton interpreter (or natively with FOLIO_KERNEL_DEVICE=cuda): uneven expert
loads with idle experts, one token, pairs that belong to no expert (another rank's, with expert
parallelism), gpt-oss's biases and clamped SwiGLU, and the sorted layout itself; and a Mixtral
through the whole engine on the Triton backend (where MoE layers take the fused kernel) gives the
torch backend's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn
from test_triton_engine import greedy_tokens

from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.triton.fused_moe import BLOCK_M, align_pairs, fused_moe, fused_moe_ref
from engine.layers.moe import SparseMoe
from engine.models.loader import load_model
from tiny_models import MOE_VARIANTS, make_checkpoint

HIDDEN, INTERMEDIATE, EXPERTS = 48, 40, 6  # neither a power of two: masked tiles


def routing(num_tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, skewed towards the low ones (expert 5 mostly idle)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, EXPERTS, generator=generator) - torch.arange(EXPERTS) * 0.15
    weights, ids = torch.softmax(scores * 4, dim=-1).topk(top_k, dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 2), (37, 2), (20, 3)])
def test_fused_moe_matches_the_loop_over_experts(dtype, num_tokens, top_k):
    x = randn(num_tokens, HIDDEN, dtype=dtype, seed=1)
    w13 = randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, dtype=dtype, seed=2, scale=0.2)
    w2 = randn(EXPERTS, HIDDEN, INTERMEDIATE, dtype=dtype, seed=3, scale=0.2)
    weights, ids = routing(num_tokens, top_k, seed=num_tokens)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, HIDDEN)
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # The interpreter rounds float32 to bfloat16 towards zero, not to nearest: over the
        # kernel's four roundings (gate_up, SiLU, its product, each pair's output) the errors
        # add up instead of cancelling, to a few units of the output's largest values.
        bound = 0.03 * expected.abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), atol=bound, rtol=0.03)
    else:
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fused_moe_with_gpt_oss_biases_and_clamped_swiglu(dtype):
    """Each GEMM adds its expert's bias row before the routing weight scales it; the
    activation between them is the one given (gpt-oss's clamped SwiGLU, its limit reached)."""
    x = randn(21, HIDDEN, dtype=dtype, seed=8)
    w13 = randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, dtype=dtype, seed=9, scale=0.2)
    w2 = randn(EXPERTS, HIDDEN, INTERMEDIATE, dtype=dtype, seed=10, scale=0.2)
    b13 = randn(EXPERTS, 2 * INTERMEDIATE, dtype=dtype, seed=11)
    b2 = randn(EXPERTS, HIDDEN, dtype=dtype, seed=12)
    weights, ids = routing(21, 2, seed=13)

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        return TorchAttentionBackend().clamped_swiglu(gate_up, 1.702, 0.5)

    out = fused_moe(x, w13, w2, weights, ids, b13, b2, act)
    expected = fused_moe_ref(x, w13, w2, weights, ids, b13, b2, act)
    assert_close(out, expected, dtype)
    unbiased = fused_moe_ref(x, w13, w2, weights, ids, None, None, act)
    assert not torch.allclose(expected.float(), unbiased.float(), atol=0.1)


def test_pairs_of_no_expert_add_nothing():
    x = randn(9, HIDDEN, dtype=torch.float32, seed=4)
    w13 = randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, dtype=torch.float32, seed=5, scale=0.2)
    w2 = randn(EXPERTS, HIDDEN, INTERMEDIATE, dtype=torch.float32, seed=6, scale=0.2)
    weights, ids = routing(9, 2, seed=7)
    local = ids.masked_fill(ids >= 3, -1)  # this rank holds experts 0-2
    out = fused_moe(x, w13, w2, weights, local)
    kept = weights.masked_fill(local < 0, 0.0)
    assert_close(out, fused_moe_ref(x, w13, w2, kept, ids), torch.float32)


def test_pairs_are_grouped_by_expert_in_whole_blocks():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]], device=DEVICE)
    sorted_pairs, block_expert = align_pairs(ids, 4, block_m=BLOCK_M)
    pad = 6  # the pair count: no pair
    expected_pairs = [1, 4] + [pad] * (BLOCK_M - 2) + [0, 2, 5] + [pad] * (BLOCK_M - 3)
    assert sorted_pairs.tolist()[: 2 * BLOCK_M] == expected_pairs
    assert (sorted_pairs[2 * BLOCK_M :] == pad).all()
    assert sorted_pairs.shape[0] == 6 + 4 * (BLOCK_M - 1)
    assert block_expert.tolist() == [0, 2] + [-1] * (block_expert.shape[0] - 2)


def test_a_mixtral_on_the_triton_backend_gives_the_torch_backends_tokens(tmp_path):
    make_checkpoint(tmp_path, *MOE_VARIANTS["mixtral"])
    model, _ = load_model(tmp_path, torch.float32, DEVICE, attention_backend="triton")
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoe) and moe.fused and moe.w13 is not None
    assert moe.w13.shape == (8, 2 * 96, 64) and not moe.experts  # stacked, the modules gone
    expected, _ = greedy_tokens(tmp_path, "torch", "cpu")
    got, hits = greedy_tokens(tmp_path, "triton", DEVICE)
    assert hits > 0
    assert got == expected
