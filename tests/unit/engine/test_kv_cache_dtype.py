"""--kv-cache-dtype bfloat16 under float32 activations, fp8 (e4m3) and fp8_e5m2 under float32
or bfloat16, on a tiny random Llama: the pool holds two (four) times the tokens of the same
budget, prompts score as transformers' float32 model does with its K and V rounded as the cache
keeps them (and within what that rounding moves without it), and a token's greedy output does
not depend on how its request was scheduled (whole or chunked prefill, a prefix hit,
preemption); where it cannot run it is refused naming the key."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.attention.kv_dtype import to_cache_dtype
from engine.engine import LLMEngine
from engine.model_runner import resolve_kv_dtype
from tiny_models import VARIANTS, make_checkpoint

# Prompt logprobs against transformers' float32 logits: float32 K/V meet them to 1e-3
# (test_prompt_logprobs), and so do a narrower pool's against transformers' attention over K and
# V rounded the same way. Unrounded, K and V rounded to bfloat16 (8 significant bits) move them
# by about 0.01 on this random model, to e4m3 (4 bits) by 0.20, to e5m2 (3 bits) by 0.25.
# (--kv-cache-dtype, torch's dtype, values a float32 value's bytes hold, that tolerance)
NARROWER = [
    ("bfloat16", torch.bfloat16, 2, 3e-2),
    ("fp8", torch.float8_e4m3fn, 4, 0.4),
    ("fp8_e5m2", torch.float8_e5m2, 4, 0.5),
]
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


def prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' logprob of each prompt token after the first."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]]


@contextlib.contextmanager
def attention_over_rounded_kv(model, kv_dtype: torch.dtype):
    """`model`'s attention over its K (after rotary) and V as a cache of `kv_dtype` keeps them
    (the rounding Folio's torch path applies, which its kernels are held to bit for bit)."""

    def attention(module, query, key, value, *args, **kwargs):
        key, value = (to_cache_dtype(x, kv_dtype).to(x.dtype) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    name = f"folio-rounded-kv-{kv_dtype}"
    AttentionInterface.register(name, attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@pytest.mark.parametrize(("name", "kv_dtype", "per_float", "tolerance"), NARROWER, ids=str)
def test_a_narrower_pool_holds_more_tokens_and_scores_prompts_as_transformers(
    llama, name, kv_dtype, per_float, tolerance, caplog
):
    directory, reference = llama
    with caplog.at_level(logging.INFO, logger="engine.model_executor"):
        narrow = engine(directory, kv_cache_dtype=name)
    torch_name = str(kv_dtype).removeprefix("torch.")
    said = f"in {torch_name} under float32 activations (--kv-cache-dtype {name}: K and V rounded"
    assert any(said in record.getMessage() for record in caplog.records)
    wide = engine(directory, kv_cache_dtype="auto")
    assert {slot.dtype for slot in narrow.executor.runner.kv_slots} == {kv_dtype}
    assert {slot.dtype for slot in wide.executor.runner.kv_slots} == {torch.float32}
    assert narrow.executor.num_blocks == per_float * wide.executor.num_blocks
    assert narrow.executor.kv_block_bytes * per_float == wide.executor.kv_block_bytes
    assert narrow.kv_cache_dtype_name == torch_name
    assert wide.kv_cache_dtype_name == "float32"

    ids = prompt(30, 1)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    _, scored = run(narrow, {"p": ids}, params)
    got = torch.tensor([logprob for _, logprob, _ in scored["p"]])
    want = prompt_logprobs(reference, ids)
    assert [token for token, _, _ in scored["p"]] == ids[1:]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
    with attention_over_rounded_kv(reference, kv_dtype):
        torch.testing.assert_close(got, prompt_logprobs(reference, ids), atol=1e-3, rtol=0)
    # The float32 pool's scores are closer still: the narrower pool's are its own, not a copy.
    _, exact = run(wide, {"p": ids}, params)
    exact_got = torch.tensor([logprob for _, logprob, _ in exact["p"]])
    torch.testing.assert_close(exact_got, prompt_logprobs(reference, ids), atol=1e-3, rtol=0)
    assert not torch.equal(got, exact_got)


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [("float32", "bfloat16"), ("float32", "fp8"), ("float32", "fp8_e5m2"), ("bfloat16", "fp8")],
)
def test_greedy_tokens_over_a_narrower_pool_do_not_depend_on_scheduling(
    llama, dtype, kv_cache_dtype
):
    directory, _ = llama
    narrower = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    prompts = {f"r{i}": prompt(19 + 5 * i, 10 + i) for i in range(4)}
    prompts["shares-r1"] = prompts["r1"][:22] + prompt(3, 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy, _ = run(engine(directory, **narrower), prompts, greedy)
    # Chunks of 5 tokens, room for about two requests at once: chunked prefills, a prefix hit
    # and preemptions.
    tight = engine(directory, max_num_batched_tokens=5, num_kv_blocks=18, **narrower)
    squeezed, _ = run(tight, prompts, greedy)
    assert tight.scheduler.num_preemptions > 0
    assert tight.kv_cache.prefix_cache_hits > 0
    assert squeezed == roomy


def test_a_kv_cache_dtype_that_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, fp8"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype bfloat16 under float32 .* CPU only"):
        resolve_kv_dtype("bfloat16", torch.float32, "cuda")
    for name in ("fp8", "fp8_e5m2"):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype {name} under bfloat16 .* CPU only"):
            resolve_kv_dtype(name, torch.bfloat16, "cuda")
    assert resolve_kv_dtype("fp8_e4m3", torch.float32, "cpu") == torch.float8_e4m3fn
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, "cuda") == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, "cpu") == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
