"""--kv-cache-dtype bfloat16 under float32 activations, on a tiny random Llama: the pool holds
twice the tokens of the same budget, prompts score as transformers' float32 model does within
what rounding K and V to bfloat16 moves, and a token's greedy output does not depend on how its
request was scheduled (whole or chunked prefill, a prefix hit, preemption); where it cannot run
it is refused naming the key."""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine
from engine.model_runner import resolve_kv_dtype
from tiny_models import VARIANTS, make_checkpoint

# Prompt logprobs against transformers' float32 logits: float32 K/V meet them to 1e-3
# (test_prompt_logprobs); K and V rounded to bfloat16 (8 significant bits) move them by about
# 1e-2 on this model.
TOLERANCE = 3e-2
BUDGET = 64 * 1024


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-kv-dtype")
    return directory, make_checkpoint(directory, *VARIANTS["llama"])


def engine(directory, **overrides) -> LLMEngine:
    args = dict(
        model=str(directory),
        dtype="float32",
        kv_cache_dtype="bfloat16",
        block_size=4,
        kv_cache_memory_bytes=BUDGET,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    return LLMEngine(EngineConfig(**{**args, **overrides}))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams):
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {}
    scored: dict[str, list] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                scored[out.request_id] = out.prompt_logprobs
    return tokens, scored


def test_a_bfloat16_pool_holds_twice_the_tokens_and_scores_prompts_as_transformers(llama):
    directory, reference = llama
    narrow, wide = engine(directory), engine(directory, kv_cache_dtype="auto")
    assert {slot.dtype for slot in narrow.executor.runner.kv_slots} == {torch.bfloat16}
    assert {slot.dtype for slot in wide.executor.runner.kv_slots} == {torch.float32}
    assert narrow.executor.num_blocks == 2 * wide.executor.num_blocks
    assert narrow.executor.kv_block_bytes * 2 == wide.executor.kv_block_bytes
    assert (narrow.kv_cache_dtype_name, wide.kv_cache_dtype_name) == ("bfloat16", "float32")

    ids = prompt(30, 1)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    _, scored = run(narrow, {"p": ids}, params)
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
    got = torch.tensor([logprob for _, logprob, _ in scored["p"]])
    want = expected[torch.arange(len(ids) - 1), ids[1:]]
    assert [token for token, _, _ in scored["p"]] == ids[1:]
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=0)
    # The float32 pool's scores are closer still: the bfloat16 pool's are its own, not a copy.
    _, exact = run(wide, {"p": ids}, params)
    exact_got = torch.tensor([logprob for _, logprob, _ in exact["p"]])
    torch.testing.assert_close(exact_got, want, atol=1e-3, rtol=0)
    assert not torch.equal(got, exact_got)


def test_greedy_tokens_over_a_bfloat16_pool_do_not_depend_on_scheduling(llama):
    directory, _ = llama
    prompts = {f"r{i}": prompt(19 + 5 * i, 10 + i) for i in range(4)}
    prompts["shares-r1"] = prompts["r1"][:22] + prompt(3, 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy, _ = run(engine(directory), prompts, greedy)
    # Chunks of 5 tokens, room for about two requests at once: chunked prefills, a prefix hit
    # and preemptions.
    tight = engine(directory, max_num_batched_tokens=5, num_kv_blocks=18)
    squeezed, _ = run(tight, prompts, greedy)
    assert tight.scheduler.num_preemptions > 0
    assert tight.kv_cache.prefix_cache_hits > 0
    assert squeezed == roomy


def test_a_kv_cache_dtype_that_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype bfloat16 under float32 .* CPU only"):
        resolve_kv_dtype("bfloat16", torch.float32, "cuda")
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, "cuda") == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, "cpu") == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
