"""Speculative decoding (engine/spec_decode): --speculative-config is checked naming its key; the
ngram proposer; greedy tokens with drafts equal those without (tiny model: chunked prefill,
preemption, n = 2, a stop token, logprobs; the default model on copy-heavy prompts); rejected drafts
leave no block, hash or KV event behind; sampled tokens keep their distribution (chi-square);
the served usage and /metrics count drafts; verification steps run the compiled CPU decode
programs, with the same greedy tokens."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from common.block_hash import ROOT_HASH, hash_block
from common.config import EngineConfig
from common.sampling_params import SamplingParams, StructuredOutput
from common.speculative import SpeculativeConfig
from engine.core.request import Request
from engine.core.step_cost import LiveStepCost, StepCostModel
from engine.engine import LLMEngine
from engine.layers import quantization
from engine.llm import LLM
from engine.sampler import Sampler
from engine.spec_decode.drafter import (
    FEW_PROBE_STEPS,
    FIRST_ONLY,
    FULL,
    MIN_MEASURED,
    PROBE_STEPS,
    TIMED_STEPS,
    Drafter,
    TokenArrays,
)
from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.suffix import SuffixIndex
from engine.spec_decode.verify import Verifier
from engine.structured_output import StructuredOutputManager
from gateway.engines.vllm_metrics import vllm_families
from gateway.openai.completions import Plan, _usage
from gateway.pipeline.text import Usage
from gateway.wire import engine_stats
from grpc_helpers import ServerThread
from services.engine.server import EngineService
from tiny_models import VARIANTS, make_checkpoint

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
SUFFIX = json.dumps({"method": "suffix", "num_speculative_tokens": 3})


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"method": "eagle"}, "method"),
        ({"method": "draft_model", "model": "x"}, "model"),
        ({"method": "draft_model"}, "model"),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 1},
            "suffix_decoding_max_tree_depth",
        ),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "ngram", "lookahead": 2}, "lookahead"),
    ],
)
def test_bad_config_is_refused_naming_the_key(values, key):
    with pytest.raises(ValueError, match=f"speculative_config: {key}:"):
        EngineConfig(speculative_config=json.dumps(values))


def test_config_keys_and_defaults():
    config = EngineConfig(speculative_config='{"method": "ngram", "prompt_lookup_max": 3}')
    assert config.speculative == SpeculativeConfig("ngram", prompt_lookup_max=3)
    with pytest.raises(ValueError, match=r"speculative_config: \(json\)"):
        EngineConfig(speculative_config="{method: ngram}")


def test_ngram_drafts_the_continuation_of_the_latest_longest_match():
    tokens = [1, 2, 3, 4, 9, 9, 2, 3, 5, 6, 7, 2, 3]
    # "2 3" occurs at 1 and at 6: the later one (followed by 5 6 7) wins.
    assert propose_ngram(tokens, 3, 1, 3) == [5, 6, 7]
    # A longer match beats a later shorter one: "4 2 3" ... occurs after 8 only.
    assert propose_ngram([8, 4, 2, 3, 5, 2, 3, 1, 4, 2, 3], 2, 1, 3) == [5, 2]
    assert propose_ngram([1, 2, 3], 4, 2, 3) == []  # nothing repeats
    assert propose_ngram([5, 5, 5], 2, 1, 2) == [5]  # a run predicts itself


def ngram_by_each_length(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The ngram proposer's rule spelled out: for n from the longest down, the latest earlier
    window equal to the last n tokens, and the k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    k=st.integers(0, 5),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_ngram_one_pass_search_equals_a_search_per_length(tokens, k, min_n, extra):
    """The proposer finds every n-gram's occurrences in one pass over the text: the same
    drafts as looking for each n in turn."""
    expected = ngram_by_each_length(tokens, k, min_n, min_n + extra) if k else []
    assert propose_ngram(tokens, k, min_n, min_n + extra) == expected


def test_suffix_drafts_the_most_frequent_continuation_across_requests():
    index = SuffixIndex(max_depth=8, max_requests=2)
    assert index.propose([7, 8, 9, 1, 2], 3) == []
    index.finished([5, 1, 2, 3, 4, 6])
    index.finished([9, 1, 2, 3, 5, 6])
    index.finished([0, 1, 2, 3, 5, 7])  # the window holds the last two outputs only
    # "1 2" continues with "3 5" twice: the most frequent continuation wins.
    assert index.propose([7, 8, 9, 1, 2], 3) == [3, 5, 6]
    # A longer match narrows the candidates: "9 1 2" occurs once.
    assert index.propose([4, 9, 1, 2], 3) == [3, 5, 6]
    assert index.propose([0, 1, 2], 3) == [3, 5, 7]
    # The request's own text counts too.
    assert SuffixIndex(8, 0).propose([4, 4, 6, 1, 4, 4], 2) == [6, 1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spec-llama")
    return directory, make_checkpoint(directory, *VARIANTS["llama"])


def engine_on(tiny, spec: str | None, **overrides) -> LLMEngine:
    args = dict(
        model=str(tiny[0]),
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        enforce_eager=True,
        speculative_config=spec,
    )
    args.update(overrides)
    engine = LLMEngine(EngineConfig(**args))
    return unmeasured(engine) if spec else engine


def unmeasured(engine: LLMEngine) -> LLMEngine:
    """The engine's drafter without its measured-step gate: drafting stops while measured step
    times say it does not pay, which depends on the machine's load (a loaded CI machine stopped
    it before any draft was accepted); unmeasured it keeps drafting, so which drafts are made
    and accepted is the same every run. The gate has its own test on a bare drafter."""
    assert engine.drafter is not None
    engine.drafter.measured = None
    return engine


def run(engine: LLMEngine, prompts, params) -> dict[tuple[str, int], list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    return tokens


def repetitive_prompts(count: int, length: int = 12, repeats: int = 3) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 150) for _ in range(length)] * repeats for _ in range(count)]


@pytest.mark.parametrize("method", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_tokens_equal_without_drafts_through_preemption_chunks_and_n2(tiny, method):
    """A small KV pool preempts, a 32-token budget chunks the prompts, n = 2 forks: every
    sample's tokens equal the engine's without speculation, and once it is all done every block
    is free again."""
    prompts = repetitive_prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    plain, spec = engine_on(tiny, None), engine_on(tiny, method)
    expected, got = run(plain, prompts, params), run(spec, prompts, params)
    assert got == expected
    stats = spec.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert spec.kv_cache.num_free_blocks == plain.kv_cache.num_free_blocks


def test_verification_steps_stay_within_the_rows_of_the_quantized_kernels(tiny, monkeypatch):
    """Past the rows their kernels take (QuantizedWeight.max_kernel_rows), int4 weights multiply
    by the dequantized weight, which rounds otherwise than the plain step of the same requests.
    Three quarters of that bound in requests, drafting, would verify in more rows: the drafter
    cuts the drafts to the bound (the longest first), and the greedy tokens are those without
    speculation. Unquantized: no bound. Without native bfloat16 Folio's kernels take 2,048
    rows, whose 1,536 requests would take minutes here: the bound is lowered to 256 for them."""
    monkeypatch.setattr(quantization, "MAX_INT4_FLOAT32_KERNEL_ROWS", 256)
    assert engine_on(tiny, None).executor.max_invariant_rows is None
    probe = engine_on(tiny, None, quantization="int4")
    bound = probe.executor.max_invariant_rows
    assert bound in (16, 128, 256)  # torch's kernels; Folio's with native bfloat16; Folio's
    count = bound * 3 // 4
    prompts = repetitive_prompts(count)
    # One prefill step for every prompt: the steps after it decode or verify only.
    int4 = dict(
        quantization="int4",
        max_num_seqs=count,
        num_kv_blocks=count * 16,
        max_num_batched_tokens=sum(map(len, prompts)),
    )
    spec = engine_on(tiny, NGRAM, **int4)
    assert spec.drafter is not None and spec.drafter.max_rows == bound
    rows: list[int] = []
    execute = spec.executor.execute

    def recording(step, started):
        if step.plan.spec_token_ids:
            rows.append(step.total_tokens)
        return execute(step, started)

    spec.executor.execute = recording
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = run(engine_on(tiny, None, **int4), prompts, params)
    assert run(spec, prompts, params) == expected
    assert max(rows) == bound, rows  # cut to the bound, not past it
    assert spec.stats().spec_num_accepted_tokens > 0


def test_a_stop_token_ends_a_drafting_request_as_without_drafts(tiny):
    """A stop token the request reaches while drafting ends it where it ends without
    speculation: tokens a step accepts past a stop are not the request's."""
    [prompt] = repetitive_prompts(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [tokens] = run(engine_on(tiny, None), [prompt], greedy).values()
    late = next(t for i, t in enumerate(tokens) if i >= 6 and t not in tokens[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[late])
    expected = run(engine_on(tiny, None), [prompt], stop)
    spec = engine_on(tiny, NGRAM)
    assert run(spec, [prompt], stop) == expected
    assert spec.stats().spec_num_draft_tokens > 0


def test_rejected_drafts_leave_the_block_table_as_without_them(tiny):
    """Step by step, a drafting request holds exactly the blocks its computed tokens need, and
    its chained hashes are those of its own tokens' full blocks; in the end the prefix cache
    holds (and KV events announced) the blocks a run without speculation leaves."""
    spec = engine_on(tiny, NGRAM, num_kv_blocks=64)
    [prompt] = repetitive_prompts(1)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    spec.add_request("r", prompt, params)
    request = spec.requests["r"]
    while True:
        spec.step()
        if request.is_finished:
            break
        if not request.output_token_ids:
            continue  # its prompt is prefilled in chunks
        assert len(request.block_table) == -(-request.num_computed_tokens // 4)
        assert request.num_computed_tokens == request.num_tokens - 1
        parent, hashes = ROOT_HASH, []
        for i in range(request.num_computed_tokens // 4):
            parent = hash_block(parent, request.token_ids[i * 4 : (i + 1) * 4])
            hashes.append(parent)
        assert request.block_hashes == hashes
    assert request.num_drafted_tokens > request.num_accepted_tokens
    plain = engine_on(tiny, None, num_kv_blocks=64)
    run(plain, [prompt], params)
    assert spec.kv_cache.announced_hashes() == plain.kv_cache.announced_hashes()


def _chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of the chi-square test that two samples of tokens share one distribution (bins
    with fewer than 10 expected pooled together)."""
    tokens = sorted(set(a) | set(b))
    counts_a, counts_b = Counter(a), Counter(b)
    ca = torch.tensor([counts_a[t] for t in tokens], dtype=torch.float64)
    cb = torch.tensor([counts_b[t] for t in tokens], dtype=torch.float64)
    small = (ca + cb) < 20
    if small.any():
        ca = torch.cat([ca[~small], ca[small].sum()[None]])
        cb = torch.cat([cb[~small], cb[small].sum()[None]])
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    statistic = float((((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum())
    df = len(total) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(statistic / 2)))


def test_rejection_sampling_keeps_the_distribution(tiny):
    """On a tiny model's own distributions p0, p1 (after a context, and after it plus a draft d
    that p0 finds likely): 20,000 verified steps give a first token distributed as p0 and, when
    d was accepted, a second token distributed as p1, as 20,000 plain draws do (chi-square
    p > 0.001); the first token is d as often as p0 says, so both paths ran."""
    _, model = tiny
    context = repetitive_prompts(1, length=10, repeats=1)[0]
    with torch.no_grad():
        p0 = model(torch.tensor([context])).logits[0, -1]
        draft = int(p0.topk(2).indices[1])  # likely, not certain: accepted and rejected
        rows = model(torch.tensor([[*context, draft]])).logits[0, -2:]
    params = SamplingParams(temperature=1.0, top_k=40)
    count = 20_000
    sampler = Sampler(rows.shape[1], [2], seed=3)
    drafting = []
    for _ in range(count):
        request = Request("r", context, params)
        request.spec_token_ids = [draft]
        drafting.append(request)
    verified = Verifier(sampler, seed=5).sample(rows.repeat(count, 1), drafting, None)
    assert verified.accepted is not None
    firsts = [a[0] if a else t for a, t in zip(verified.accepted, verified.token_ids, strict=True)]
    seconds = [t for a, t in zip(verified.accepted, verified.token_ids, strict=True) if a]
    plain = [Request("r", context, params) for _ in range(count)]
    expected_firsts = sampler.sample(rows[:1].repeat(count, 1), plain).token_ids
    expected_seconds = sampler.sample(rows[1:].repeat(count, 1), plain).token_ids
    assert 0.05 < len(seconds) / count < 0.95
    assert _chi_square_p(firsts, expected_firsts) > 0.001
    assert _chi_square_p(seconds, expected_seconds[: len(seconds)]) > 0.001


def test_greedy_verification_accepts_what_the_one_hot_rows_accept():
    """All-greedy verification takes each row's greedy token instead of one-hot rows over the
    vocabulary: the same accepted drafts and next token as the general path (rejection
    sampling over those rows), with logit bias and a structured-output mask in play, drafts
    accepted whole, in part and not at all, and ties in the logits."""
    vocab = 50
    sampler = Sampler(vocab, [2], seed=0)
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(40, vocab + 6, generator=generator).round(decimals=1)  # ties
    greedy = logits[:, :vocab].argmax(-1).tolist()
    requests, begin = [], 0
    for i, k in enumerate([3, 1, 4, 2, 4, 3, 2, 4, 1, 4]):
        biased = i % 3 == 0
        params = SamplingParams(temperature=0.0, logit_bias={5: 100.0} if biased else None)
        request = Request(f"r{i}", [1, 2, 3], params)
        request.append_output(4)
        rows_greedy = [5] * (k + 1) if biased else greedy[begin : begin + k + 1]
        accepted = i % 4  # drafts equal to the greedy tokens before a wrong one
        request.spec_token_ids = [
            t if j < accepted else (t + 1) % vocab for j, t in enumerate(rows_greedy[:k])
        ]
        requests.append(request)
        begin += k + 1
    rows = logits[:begin]
    disallowed = torch.zeros(begin, vocab, dtype=torch.bool)
    disallowed[7, greedy[7]] = True  # a grammar's mask moves one row's greedy token
    verifier = Verifier(sampler, seed=1)
    fast = verifier.sample(rows, requests, disallowed)
    starts = [0]
    for request in requests[:-1]:
        starts.append(starts[-1] + len(request.spec_token_ids) + 1)
    expanded = [r for r in requests for _ in range(len(r.spec_token_ids) + 1)]
    probs = sampler.processed_probs(rows, expanded, disallowed)
    general = verifier._verify(probs, requests, starts)
    assert [[*a, t] for a, t in zip(fast.accepted, fast.token_ids, strict=True)] == general
    assert {len(a) for a in fast.accepted} >= {0, 1, 2, 3}


@pytest.fixture(scope="module", params=["directory", "gguf"])
def smollm2(request, default_model_dir):
    """The default model as a float32 directory, and as it is served by default: its GGUF file
    on the integer kernels (whose rows are added alike in any batch, so verification rows give
    what decode rows give)."""
    model = str(default_model_dir) if request.param == "directory" else None
    with (
        LLM(model, dtype="float32", enforce_eager=True) as plain,
        LLM(model, dtype="float32", enforce_eager=True, speculative_config=NGRAM) as spec,
    ):
        unmeasured(spec.engine)
        yield plain, spec


COPY_PROMPTS = [
    "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    "
    "return a - b\n\nRepeated:\ndef add(a, b):\n",
    "Copy the list: apple, banana, cherry, date, elderberry, fig, grape. Copy: apple, banana,",
]


def test_default_model_greedy_equal_on_copy_heavy_prompts(smollm2):
    plain, spec = smollm2
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected, got = plain.generate(COPY_PROMPTS, params), spec.generate(COPY_PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert sum(r.num_accepted_tokens for r in got) > 0


def test_a_constrained_requests_drafts_are_cut_where_its_grammar_refuses(default_model_dir):
    """Drafts of a request under a grammar end before the first token the grammar refuses
    after its output so far (the default model's tokenizer, llguidance's own check)."""
    structured = StructuredOutputManager(default_model_dir, 49152, [2])
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    one, two, x = (tokenizer.token_to_id(t) for t in ("1", "2", "x"))
    drafter = Drafter(
        SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1),
        max_model_len=1000,
        step_cost=None,
        grammar_allows=structured.allowed_prefix,
    )
    drafter.measured = None
    digits = StructuredOutput(regex="[0-9]+")
    tokens = [one, two, x, one, two, x, one]
    constrained, free = drafting_request(tokens, structured_output=digits), drafting_request(tokens)
    drafter.propose([constrained, free])
    assert free.spec_token_ids == [two, x, one]
    assert constrained.spec_token_ids == [two]  # "1" then "2" is a number, "12x" is not


def test_default_model_greedy_equal_under_a_grammar(smollm2):
    """Requests under a JSON schema and a regex draft, their drafts verified under the
    grammar's mask at each position: the greedy tokens those of the engine without drafts,
    drafts accepted, the output valid."""
    plain, spec = smollm2
    record = '{"name": "Ada Lovelace", "city": "London", "born": 1815}'
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"type": "string"},
            "born": {"type": "integer"},
        },
        "required": ["name", "city", "born"],
        "additionalProperties": False,
    }
    prompts = [f"Repeat this JSON exactly: {record}\nRepeated: ", "Count: 1 2 3 4 5 1 2 3 4 5 1"]
    constraints = [StructuredOutput(json=schema), StructuredOutput(regex="( [1-5])+")]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_output=c) for c in constraints
    ]
    expected, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert got[0].num_accepted_tokens > 0 and got[1].num_accepted_tokens > 0
    assert json.loads(got[0].text) == json.loads(record)


def test_verification_steps_run_compiled_with_the_greedy_tokens_of_compiled_decode(tiny):
    """With compiled CPU decode, a step that only verifies drafts runs its tokens through the
    compiled programs as one-token rows (counted apart), and the greedy tokens equal those of
    the compiled engine without speculation, through chunked prompts and preemption."""
    prompts = repetitive_prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    compiled = dict(enforce_eager=False, decode_compile="startup")
    plain, spec = engine_on(tiny, None, **compiled), engine_on(tiny, NGRAM, **compiled)
    expected, got = run(plain, prompts, params), run(spec, prompts, params)
    assert got == expected
    programs = spec.executor.runner.compiled_decode
    assert programs is not None and programs.ready
    assert programs.verify_steps_run > 0
    # Verification rows: each request's last token and its drafts, more rows than requests.
    assert max(programs.rows_run) > len(prompts)
    stats = spec.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


def test_served_usage_and_vllm_metrics_count_drafts(tiny):
    """Over the engine service: the last output's usage carries the request's drafted and
    accepted tokens, GetStats the engine's counters, and /metrics names them as vLLM does."""
    service = EngineService(
        EngineConfig(
            model=str(tiny[0]),
            dtype="float32",
            num_kv_blocks=64,
            enforce_eager=True,
            speculative_config=NGRAM,
        ),
        "127.0.0.1",
        0,
    )
    server = ServerThread(service)
    try:
        stub = engine_pb2_grpc.EngineServiceStub(server.channel)
        request = engine_pb2.EngineRequest(
            request_id="r",
            prompt_token_ids=repetitive_prompts(1)[0],
            sampling_params=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=20, ignore_eos=True
            ),
        )
        responses = stub.Generate(iter([engine_pb2.GenerateRequest(add=request)]), timeout=60)
        [last] = [o for r in responses for o in r.outputs if o.finished]
        stats = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=60)
    finally:
        server.close()
    assert last.usage.draft_tokens == stats.spec_num_draft_tokens > 0
    assert last.usage.accepted_draft_tokens == stats.spec_num_accepted_tokens
    families = {f.name: f for f in vllm_families(engine_stats(stats))}
    [sample] = families["vllm:spec_decode_num_draft_tokens"].samples
    assert sample.value == stats.spec_num_draft_tokens
    assert families["vllm:spec_decode_num_drafts"].samples[0].value == stats.spec_num_drafts > 0


def test_openai_usage_names_accepted_and_rejected_drafts():
    """The OpenAI usage of a request whose choices drafted tokens: completion_tokens_details
    with OpenAI's Predicted Outputs names, summed over the choices; absent without drafts."""
    plan = Plan(False, "cmpl", "m", [], 2, False, True, 0)
    usages: list[Usage | None] = [Usage(7, 20, 0, 12, 9), Usage(7, 18, 0, 4, 1)]
    details = _usage(plan, usages).completion_tokens_details
    assert details is not None
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (10, 6)
    assert _usage(plan, [Usage(7, 20), Usage(7, 18)]).completion_tokens_details is None


def bare_drafter(config: SpeculativeConfig, step_cost: LiveStepCost | None = None) -> Drafter:
    """A drafter on its own, without the measured-step gate (tested on its own below)."""
    drafter = Drafter(config, max_model_len=1000, step_cost=step_cost)
    drafter.measured = None
    return drafter


def drafting_request(tokens: list[int], **params) -> Request:
    """A request decoding after its first output token, as the drafter sees it."""
    request = Request("d", tokens[:-1], SamplingParams(**params))
    request.append_output(tokens[-1])
    request.num_computed_tokens = request.num_tokens - 1
    return request


@given(growth=st.lists(st.lists(st.integers(0, 9), max_size=70), min_size=1, max_size=8))
def test_a_requests_token_array_follows_its_tokens_as_they_grow(growth):
    """The drafter's array of a request's tokens, extended step by step (past its buffer's
    room too), is always its tokens, and the ngram proposer drafts the same from it."""
    arrays = TokenArrays()
    request = drafting_request([1, 2])
    for tokens in growth:
        for token in tokens:
            request.append_output(token)
        array = arrays.of(request)
        assert array.tolist() == request.token_ids
        assert propose_ngram(array, 3, 1, 3) == propose_ngram(request.token_ids, 3, 1, 3)


def test_draft_length_follows_acceptance_and_low_acceptance_pauses():
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    drafter = bare_drafter(config)
    request = drafting_request([1, 2, 3, 4, 5, 6, 7, 8, 9] * 3)
    drafter.propose([request])
    assert request.spec_token_ids == [1, 2, 3]  # starting rate 0.5: 2 expected + 1
    for _ in range(3):
        drafter.settle(request, 3, 3)
    drafter.propose([request])
    assert len(request.spec_token_ids) == 4  # all accepted: the full length
    for _ in range(8):
        drafter.settle(request, 4, 0)
        drafter.propose([request])
        if not request.spec_token_ids:
            break
    assert request.spec_token_ids == []  # rejected again and again: it pauses
    waits = []
    for _ in range(3):
        waited = 0
        while not request.spec_token_ids:
            drafter.propose([request])
            waited += 1
        assert request.spec_token_ids == [1]  # then it tries one token
        waits.append(waited)
        drafter.settle(request, 1, 0)  # rejected: paused twice as long
        drafter.propose([request])
    assert waits == [waits[0], 2 * waits[0], 4 * waits[0]], waits
    # An accepted try ends the doubling: the next pause is the first one's length again.
    while not request.spec_token_ids:
        drafter.propose([request])
    drafter.settle(request, 1, 1)
    for _ in range(8):
        drafter.settle(request, 1, 0)
        drafter.propose([request])
        if not request.spec_token_ids:
            break
    waited = 0
    while not request.spec_token_ids:
        drafter.propose([request])
        waited += 1
    assert waited == waits[0]
    assert drafter.stats.num_draft_tokens == request.num_drafted_tokens


def test_a_new_request_starts_at_the_engines_recent_acceptance():
    """Requests before it whose drafts were rejected: a new request tries one token first;
    accepted: it drafts the whole length at once (a fresh engine starts at 0.5)."""
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3
    for accepted, first_length in ((0, 1), (4, 4)):
        drafter = bare_drafter(config)
        for _ in range(40):
            earlier = drafting_request(tokens)
            drafter.propose([earlier])
            drafter.settle(earlier, 4, accepted)
        request = drafting_request(tokens)
        drafter.propose([request])
        assert len(request.spec_token_ids) == first_length, accepted
        # Its own verification steps decide from there: three all accepted, three all rejected.
        for _ in range(3):
            drafter.settle(request, 4, 4 - accepted)
        drafter.propose([request])
        assert len(request.spec_token_ids) == (4 if accepted == 0 else 2), accepted


def test_drafting_stops_for_a_batch_where_verifying_costs_more_than_it_saves():
    """With a step cost model (fixed 20 ms, 1 ms per prefill token, 0.5 ms per decoding
    sequence) and rate 0.5 drafting pays while B < 0.5 * 20 / (1 - 0.25) = 13.3 sequences."""
    config = SpeculativeConfig("ngram", num_speculative_tokens=2, prompt_lookup_min=1)
    cost = LiveStepCost(StepCostModel(0.02, 0.001, 0.0005))
    drafter = bare_drafter(config, cost)
    for size, drafts in ((13, True), (14, False)):
        batch = [drafting_request([1, 2, 3, 1, 2, 3]) for _ in range(size)]
        drafter.propose(batch)
        assert all(bool(r.spec_token_ids) == drafts for r in batch), size


def test_requests_whose_distribution_follows_their_drafts_never_draft():
    drafter = bare_drafter(SpeculativeConfig("ngram", prompt_lookup_min=1))
    tokens = [1, 2, 3, 1, 2, 3]
    for params in (
        dict(repetition_penalty=1.2),
        dict(frequency_penalty=0.5),
        dict(min_tokens=5),
        dict(bad_words_token_ids=[[7], [2, 9]]),
        dict(bad_words_token_ids=[[7]]),
        dict(allowed_token_ids=[1, 2, 3]),
    ):
        request = drafting_request(tokens, **params)
        drafter.propose([request])
        assert request.spec_token_ids == [], params


def measured_step(
    drafter: Drafter, batch: int, seconds: Callable[[int], float], accepted: int
) -> int:
    """One decode-only step of `batch` fresh requests (each at the starting acceptance rate,
    so its full draft length is 3) as the engine runs it: propose, verify (the first
    `accepted` drafts of each request accepted), the step's time observed: `seconds(drafts)`
    a sequence. Returns the drafts a request."""
    requests = [drafting_request([1, 2, 3, 1, 2, 3]) for _ in range(batch)]
    drafter.propose(requests)
    drafts = len(requests[0].spec_token_ids)
    for request in requests:
        if request.spec_token_ids:
            k = len(request.spec_token_ids)
            drafter.settle(request, k, min(k, accepted))
    drafter.observe_step(drafts > 0, batch, seconds(drafts) * batch)
    return drafts


def flat(drafts: int) -> float:
    """Memory-bound: drafts nearly free (0.1 s a sequence, 0.01 s a draft)."""
    return 0.1 + 0.01 * drafts


def steep(drafts: int) -> float:
    """Compute-bound: each draft costs what a sequence does."""
    return 0.1 + 0.1 * drafts


def knee(drafts: int) -> float:
    """The first draft nearly free, the next ones twice a sequence."""
    return 0.1 + 0.01 * min(drafts, 1) + 0.2 * max(drafts - 1, 0)


def test_drafting_follows_the_steps_measured_at_each_batch_size_and_probes_again():
    """At a batch size never measured the drafter runs a plain step, then one with a single
    draft a request; while single drafts do not pay it measures them again once every
    PROBE_STEPS steps (FEW_PROBE_STEPS while fewer than MIN_MEASURED are); when they pay, full
    lengths; when those stop paying, single drafts, with full lengths tried as often. One slow
    step does not stop drafting; another batch size is measured afresh."""
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    drafter = Drafter(config, max_model_len=1000, step_cost=None)
    assert measured_step(drafter, 1, steep, accepted=0) == 0  # plain first
    assert measured_step(drafter, 1, steep, accepted=0) == 1  # twice the time, 1 token: no
    # Measured again every FEW_PROBE_STEPS steps until MIN_MEASURED, then every PROBE_STEPS.
    drafted = [measured_step(drafter, 1, steep, accepted=0) for _ in range(FEW_PROBE_STEPS)]
    assert drafted == [0] * (FEW_PROBE_STEPS - 1) + [1]
    while drafter.measured.count(FIRST_ONLY, 1) < MIN_MEASURED:
        measured_step(drafter, 1, steep, accepted=0)
    drafted = [measured_step(drafter, 1, steep, accepted=0) for _ in range(PROBE_STEPS - 1)]
    assert drafted == [0] * (PROBE_STEPS - 1)
    # Drafts now cost little: once the probes say single drafts pay, full lengths are tried.
    steps = 0
    while measured_step(drafter, 1, flat, accepted=3) < 3:
        steps += 1
        assert steps <= TIMED_STEPS * PROBE_STEPS
    assert drafter.measured.pays(FIRST_ONLY, 1, waiting=False)
    assert measured_step(drafter, 1, lambda d: 5.0, accepted=3) == 3  # one slow step
    # Past the first draft each costs twice a sequence: full lengths stop paying, single
    # drafts still pay.
    steps = 0
    while measured_step(drafter, 1, knee, accepted=1) != 1:
        steps += 1
        assert steps <= TIMED_STEPS
    while drafter.measured.count(FULL, 1) < MIN_MEASURED:
        measured_step(drafter, 1, knee, accepted=1)
    drafted = [measured_step(drafter, 1, knee, accepted=1) for _ in range(PROBE_STEPS)]
    assert sorted(drafted) == [1] * (PROBE_STEPS - 1) + [3]
    # Another batch size: a plain step first again.
    assert measured_step(drafter, 16, flat, accepted=3) == 0


def test_one_stream_drafts_full_lengths_as_soon_as_its_own_drafts_are_accepted_again():
    """One request, drafts nearly free: its first full-length drafts were all rejected (an
    answer's preamble), so the full-length steps measured say they do not pay. Its own
    acceptance rate, still a third after the rejections, says they do, and it drafts full
    lengths at every step from then on (accepted: the part it copies), not single drafts with
    full lengths only on the probes that measure them again (one step in FEW_PROBE_STEPS)."""
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    drafter = Drafter(config, max_model_len=1000, step_cost=None)
    request = drafting_request([1, 2, 3, 4, 5, 6, 7, 8, 9] * 3)

    def step(accepted: int) -> int:
        drafter.propose([request])
        drafts = len(request.spec_token_ids)
        if drafts:
            drafter.settle(request, drafts, min(drafts, accepted))
        drafter.observe_step(drafts > 0, 1, flat(drafts))
        return drafts

    assert step(accepted=0) == 0  # a plain step first
    assert step(accepted=1) == 1  # single drafts: accepted, and they pay
    rejected = []
    while drafter.measured.count(FULL, 1) < 2:
        rejected.append(step(accepted=0))
    assert rejected == [4, 3]  # full lengths tried (rates 0.65, 0.455), all rejected
    assert drafter.measured.pays(FULL, 1, waiting=False) is False
    accepted = [step(accepted=4) for _ in range(2 * FEW_PROBE_STEPS)]
    assert all(drafts > 1 for drafts in accepted), accepted


def draining_step(drafter: Drafter, batch: int, accepting: int) -> int:
    """One decode-only step of `batch` fresh requests, of which the first `accepting` accept
    all their drafts and the rest none, timed as on 2 cores: 11 ms for one sequence, 17 ms
    for 16 (0.4 ms a sequence more), each verified draft 0.5625 ms. Returns the drafts a
    request."""
    requests = [drafting_request([1, 2, 3, 1, 2, 3]) for _ in range(batch)]
    drafter.propose(requests)
    drafts = len(requests[0].spec_token_ids)
    for i, request in enumerate(requests):
        if request.spec_token_ids:
            k = len(request.spec_token_ids)
            drafter.settle(request, k, k if i < accepting else 0)
    drafter.observe_step(drafts > 0, batch, 0.0106 + 0.0004 * batch + 0.0005625 * drafts * batch)
    return drafts


def test_drafts_accepted_by_part_of_a_batch_count_what_a_draining_batch_saves():
    """16 sequences, one draft each (26 ms against 17 ms plain), 12 of them accepted: 28
    tokens, 0.93 ms a token against 1.06 plain. Worth it while finished requests make room
    for new ones; but when the batch drains (no new requests), the 4 that accepted nothing
    keep it stepping, and the 12 early ones save only 0.4 ms a token (a 12-sequence step
    against a 16-sequence one). Once the plain steps of one sequence (11 ms) say what a
    sequence costs at the margin, single drafts do not pay there; when every sequence
    accepts, the batch advances two tokens a step and they do."""
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)

    def single_drafts_pay(one_stream_first: bool, accepting: int) -> bool | None:
        drafter = Drafter(config, max_model_len=1000, step_cost=None)
        if one_stream_first:
            assert draining_step(drafter, 1, accepting=1) == 0  # plain first
        assert draining_step(drafter, 16, accepting) == 0  # plain first
        assert draining_step(drafter, 16, accepting) == 1  # then single drafts
        assert drafter.measured is not None
        return drafter.measured.pays(FIRST_ONLY, 16, waiting=False)

    assert single_drafts_pay(one_stream_first=False, accepting=12)  # no margin known
    assert single_drafts_pay(one_stream_first=True, accepting=16)
    assert single_drafts_pay(one_stream_first=True, accepting=12) is False
    drafter = Drafter(config, max_model_len=1000, step_cost=None)
    draining_step(drafter, 1, accepting=1)
    draining_step(drafter, 16, accepting=12)
    assert drafter.measured is not None
    assert drafter.measured.marginal_share(16) == pytest.approx(0.0004 / (0.017 / 16), rel=1e-3)
    assert drafter.measured.marginal_share(1) == 1.0


def test_while_requests_wait_drafts_accepted_by_part_of_a_batch_count_a_whole_share():
    """The same steps as above (12 of 16 sequences accept their single drafts, 1 and 16
    sequences' plain steps measured), but requests wait for a place: an early finisher's place
    goes to one of them at once, so its tokens are worth a plain step's whole share and single
    drafts pay. The engine passes the requests its last step left waiting, not those that
    just arrived (a batch with room takes them at once)."""
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    drafter = Drafter(config, max_model_len=1000, step_cost=None)
    draining_step(drafter, 1, accepting=1)
    draining_step(drafter, 16, accepting=12)
    draining_step(drafter, 16, accepting=12)
    assert drafter.measured is not None
    assert drafter.measured.pays(FIRST_ONLY, 16, waiting=False) is False
    assert drafter.measured.pays(FIRST_ONLY, 16, waiting=True)
    # The drafter's own choice follows: with none waiting it drafts only on its probes; with
    # requests waiting single drafts every step (then full lengths, measured first).
    waiting = [drafting_request([1, 2, 3, 1, 2, 3]) for _ in range(16)]
    drafter.propose(waiting, num_waiting=3)
    assert all(len(r.spec_token_ids) >= 1 for r in waiting)
    drafter.propose(waiting, num_waiting=0)
    assert all(r.spec_token_ids == [] for r in waiting)


def run_with_logprobs(engine: LLMEngine, prompts, params) -> dict[str, list]:
    """Each request's (token, logprob record) pairs, in order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    records: dict[str, list] = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert len(out.new_logprobs) == len(out.new_token_ids)
            records.setdefault(out.request_id, []).extend(
                zip(out.new_token_ids, out.new_logprobs, strict=True)
            )
    return records


def test_logprobs_of_accepted_drafts_equal_those_without_drafts(tiny):
    """Greedy requests asking for logprobs and top logprobs: every token's record (its logprob,
    the top 3 ids and their logprobs) with ngram drafts equals the record without them, within
    1e-4 in float32, accepted drafts included."""
    prompts = repetitive_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    expected = run_with_logprobs(engine_on(tiny, None), prompts, params)
    spec = engine_on(tiny, NGRAM)
    got = run_with_logprobs(spec, prompts, params)
    assert spec.stats().spec_num_accepted_tokens > 0
    assert got.keys() == expected.keys()
    for rid, records in expected.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in records]
        for (_, (value, top)), (_, (want, want_top)) in zip(got[rid], records, strict=True):
            assert value == pytest.approx(want, abs=1e-4)
            assert [i for i, _ in top] == [i for i, _ in want_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)
            assert len(top) == 3


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spec-llama-4-layers")
    config_class, kwargs = VARIANTS["llama"]
    return directory, make_checkpoint(directory, config_class, dict(kwargs, num_hidden_layers=4))


def test_bfloat16_compiled_rows_keep_their_bits_alone_beside_a_copy_and_verified(four_layers):
    """In bfloat16 with compiled decode, a greedy request's tokens and their logprobs are the
    same bits alone (the one-row program), beside a copy of itself (the several-row program)
    and with ngram drafts (its verification steps: several rows), accepted drafts included.
    Four layers: with two, inductor fused both programs alike; with four it fused a residual
    add and its sum of squares at one row only, which rounded otherwise (until the programs
    rounded every bfloat16 value as eager decoding does)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    compiled = dict(dtype="bfloat16", enforce_eager=False, decode_compile="startup")
    plain, spec = (
        engine_on(four_layers, None, **compiled),
        engine_on(four_layers, NGRAM, **compiled),
    )
    # The second prompt's greedy text repeats itself: drafts are accepted there.
    for prompt in repetitive_prompts(2):
        alone = run_with_logprobs(plain, [prompt], params)["0"]
        beside = run_with_logprobs(plain, [prompt] * 2, params)
        assert beside["0"] == alone and beside["1"] == alone
        assert run_with_logprobs(spec, [prompt], params)["0"] == alone
    programs = plain.executor.runner.compiled_decode
    assert programs is not None and {1, 2} <= set(programs.rows_run)
    assert spec.stats().spec_num_accepted_tokens > 0
