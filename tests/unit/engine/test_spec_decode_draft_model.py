"""Speculative decoding with a draft model (engine/spec_decode/draft_model.py), on tiny random
models built here in float32: greedy tokens equal those without speculation through chunked
prompts, preemption and n = 2, with a draft of other weights and with the target's own weights
(whose drafts are all accepted); a stop token ends a request as without drafts; the draft
model's KV blocks all go back to its pool when requests end or are aborted; each request's
drafted and accepted counts reach its last output; a draft model of another vocabulary, or no
model at the path, is refused at start-up naming it."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_spec_decode import engine_on as spec_engine_on
from transformers import LlamaConfig

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.spec_decode.draft_model import DraftModel
from gateway_helpers import GatewayThread
from grpc_helpers import ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import SMALL, VARIANTS, make_checkpoint, make_tiny_smollm2

# A draft smaller than the target: one layer, half the width, the same vocabulary.
DRAFT = dict(
    SMALL,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Directories: the target, a smaller draft of other weights, a copy of the target, and
    one of the target with a little noise on every weight (about half its drafts accepted)."""
    root = tmp_path_factory.mktemp("draft-model")
    make_checkpoint(root / "target", *VARIANTS["llama"])
    make_checkpoint(root / "small", LlamaConfig, DRAFT, seed=1)
    shutil.copytree(root / "target", root / "same")
    shutil.copytree(root / "target", root / "noisy")
    weights = root / "noisy" / "model.safetensors"
    noise = torch.Generator().manual_seed(2)
    save_file(
        {
            k: v + 0.006 * torch.randn(v.shape, generator=noise)
            for k, v in load_file(weights).items()
        },
        weights,
        metadata={"format": "pt"},
    )
    return root


def spec_config(draft, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})


def engine_on(models, draft: str | None, **overrides) -> LLMEngine:
    """The target, drafting with `draft` (a directory under `models`) or not at all, without
    the measured-step gate (test_spec_decode.engine_on's settings)."""
    spec = spec_config(models / draft) if draft else None
    return spec_engine_on((models / "target",), spec, **overrides)


def draft_model(engine: LLMEngine) -> DraftModel:
    proposer = engine.executor.draft_proposer
    assert isinstance(proposer, DraftModel)
    return proposer


def prompts(count: int, length: int = 36) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 150) for _ in range(length)] for _ in range(count)]


def run(engine: LLMEngine, batch, params, each_step: Callable[[], None] = lambda: None):
    """Each sample's tokens, and its last output's (drafted, accepted) counts; `each_step`
    runs after every step."""
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    counts: dict[tuple[str, int], tuple[int, int]] = {}
    while engine.has_unfinished:
        outputs = engine.step()
        each_step()
        for out in outputs:
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                counts[key] = (out.num_draft_tokens, out.num_accepted_tokens)
    return tokens, counts


@pytest.fixture(scope="module")
def plain(models):
    """Greedy tokens without speculation: 5 prompts of 36 tokens (chunked by the 32-token
    budget), n = 2, 16 tokens each, in a pool small enough to preempt."""
    engine = engine_on(models, None)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    tokens, _ = run(engine, prompts(5), params)
    assert engine.stats().num_preemptions > 0
    return tokens, params


@pytest.mark.parametrize("draft", ["small", "same", "noisy"])
def test_greedy_tokens_equal_without_drafts_and_the_draft_pool_is_freed(models, plain, draft):
    """Greedy tokens as without speculation; the draft model holds blocks only for requests
    that were running when the step began (a preempted one's are freed at the next step's
    drafting), and none once all ended."""
    expected, params = plain
    engine = engine_on(models, draft)
    pool = draft_model(engine)
    before: set[str] = set()

    def held_by_running_only() -> None:
        assert pool.holding <= before
        before.clear()
        before.update(r.request_id for r in engine.scheduler.running)

    got, counts = run(engine, prompts(5), params, held_by_running_only)
    assert got == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_num_drafts > 0
    # Every request's counts reach its last output, and they add up to the engine's.
    assert len(counts) == len(expected)
    assert sum(d for d, _ in counts.values()) == stats.spec_num_draft_tokens
    assert sum(a for _, a in counts.values()) == stats.spec_num_accepted_tokens
    drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    if draft == "same":
        # The target's own weights draft the target's own greedy tokens.
        assert accepted >= 0.95 * drafted
        assert all(a >= 0.9 * d and d > 0 for d, a in counts.values())
    elif draft == "noisy":
        # Accepted and rejected drafts: the draft's cache keeps the former, rewrites the latter.
        assert 0.2 * drafted < accepted < 0.8 * drafted
    else:
        assert accepted < drafted
    assert pool.num_free_blocks == pool.num_blocks - 1  # all but the null block


@pytest.mark.parametrize(
    ("kv_cache_dtype", "kv_dtype"), [("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)]
)
def test_over_narrower_kv_caches_greedy_tokens_equal_without_drafts(
    models, kv_cache_dtype, kv_dtype
):
    """--kv-cache-dtype bfloat16 or fp8: the target's pool and the draft model's are in it, and
    the greedy tokens are those of the same engine without speculation (verification rows read
    the cache as decodes do)."""
    narrow = dict(kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected, _ = run(engine_on(models, None, **narrow), prompts(3), params)
    engine = engine_on(models, "same", **narrow)
    assert {c.dtype for c in draft_model(engine).kv_caches} == {kv_dtype}
    assert engine.executor.runner.kv_slots[0].dtype == kv_dtype
    got, _ = run(engine, prompts(3), params)
    assert got == expected
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0


@pytest.fixture(scope="module")
def smol(tmp_path_factory, default_model_dir):
    """A tiny random model with SmolLM2's vocabulary and tokenizer, and a copy of it as its
    draft (so drafts are accepted and steps yield several tokens)."""
    root = tmp_path_factory.mktemp("draft-smol")
    make_tiny_smollm2(root / "target", default_model_dir)
    shutil.copytree(root / "target", root / "draft")
    return root


def test_a_stop_token_ends_a_drafting_request_as_without_drafts(smol):
    """Through the offline API: a stop token met inside a step's accepted drafts ends the
    request there, as without speculation."""
    prompt = "Once upon a time"
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    target = str(smol / "target")
    with (
        LLM(target, dtype="float32", enforce_eager=True) as without,
        LLM(
            target,
            dtype="float32",
            enforce_eager=True,
            speculative_config=spec_config(smol / "draft"),
        ) as speculating,
    ):
        assert speculating.engine.drafter is not None
        speculating.engine.drafter.measured = None
        [full] = without.generate([prompt], greedy)
        tokens = full.token_ids
        late = next(t for i, t in enumerate(tokens) if i >= 6 and t not in tokens[:i])
        params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[late])
        [want] = without.generate([prompt], params)
        [got] = speculating.generate([prompt], params)
    assert got.token_ids == want.token_ids
    assert got.token_ids[-1] == late
    assert got.num_accepted_tokens > 0


def test_a_stop_string_ends_the_text_as_without_drafts(smol):
    """Through the gateway (stop strings are matched on the text there): the text,
    finish_reason and completion tokens of a drafting engine equal those of a plain one, and
    the usage names the drafts."""
    tokenizer = ServerThread(TokenizerService(str(smol / "target"), "127.0.0.1", 0))
    servers, urls = [tokenizer], []
    for spec in (None, spec_config(smol / "draft")):
        config = EngineConfig(
            model=str(smol / "target"),
            dtype="float32",
            num_kv_blocks=64,
            enforce_eager=True,
            speculative_config=spec,
        )
        engine = ServerThread(EngineService(config, "127.0.0.1", 0))
        gateway = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
        servers += [engine, gateway]
        urls.append(gateway.url + "/v1/completions")
    try:
        plain, speculating = urls

        def complete(url: str, **params) -> dict:
            body = dict(prompt="Once upon a time", max_tokens=24, temperature=0.0, **params)
            response = httpx.post(url, json=body, timeout=60)
            response.raise_for_status()
            return response.json()

        full = complete(plain)["choices"][0]["text"]
        stop = next(
            full[start:end]
            for start in range(len(full) // 3, len(full))
            for end in range(start + 2, len(full) + 1)
            if full.find(full[start:end]) == start
        )
        want, got = complete(plain, stop=[stop]), complete(speculating, stop=[stop])
    finally:
        for server in reversed(servers):
            server.close()
    assert want["choices"][0]["finish_reason"] == "stop"
    assert len(want["choices"][0]["text"]) < len(full)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    # The drafting engine's first decode steps draft (the measured-step gate measures single
    # drafts before deciding), and a copy of the target's weights drafts its tokens.
    assert got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


def test_aborted_requests_give_their_draft_blocks_back(models):
    engine = engine_on(models, "small", num_kv_blocks=64)
    pool = draft_model(engine)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts(3)):
        engine.add_request(str(i), prompt, params)
    while engine.stats().spec_num_drafts < 6:
        engine.step()
    assert pool.holding == {"0", "1", "2"}
    engine.abort("1")
    assert pool.holding == {"0", "2"}
    engine.abort("0")
    engine.abort("2")
    assert not pool.holding
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_the_draft_models_decode_steps_run_compiled(models):
    """With compiled CPU decode, the draft model's decode steps run programs of its own, its
    drafts the same greedy tokens as eagerly (a copy of the target's weights: all accepted),
    and the greedy tokens equal the compiled engine's without speculation."""
    compiled = dict(enforce_eager=False, decode_compile="startup", num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain, engine = engine_on(models, None, **compiled), engine_on(models, "same", **compiled)
    for batch in (prompts(3), prompts(1)):  # several rows, then one (a program of its own)
        assert run(engine, batch, params)[0] == run(plain, batch, params)[0]
    programs = draft_model(engine).compiled_decode
    assert programs is not None and programs.ready
    assert programs.rows_run[1] > 0 and programs.rows_run[3] > 0
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0


def test_a_draft_model_of_another_vocabulary_is_refused_naming_both(models, tmp_path):
    make_checkpoint(tmp_path, LlamaConfig, dict(DRAFT, vocab_size=170))
    with pytest.raises(ValueError, match=r"speculative_config: model: .*170 tokens.*160 tokens"):
        LLMEngine(
            EngineConfig(
                model=str(models / "target"),
                dtype="float32",
                num_kv_blocks=16,
                enforce_eager=True,
                speculative_config=spec_config(tmp_path),
            )
        )


def test_a_draft_model_under_tensor_parallelism_is_refused_naming_the_method(models):
    with pytest.raises(ValueError, match="speculative_config: method draft_model with tensor"):
        LLMEngine(
            EngineConfig(
                model=str(models / "target"),
                dtype="float32",
                num_kv_blocks=16,
                tensor_parallel_size=2,
                speculative_config=spec_config(models / "target"),
            )
        )


def test_a_missing_draft_model_is_refused_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"speculative_config: model: no model at '{missing}'"):
        EngineConfig(speculative_config=spec_config(missing))
    with pytest.raises(ValueError, match="speculative_config: model: required"):
        EngineConfig(speculative_config='{"method": "draft_model"}')
    with pytest.raises(ValueError, match="speculative_config: model: only for method draft_model"):
        EngineConfig(speculative_config=json.dumps({"method": "ngram", "model": str(tmp_path)}))
