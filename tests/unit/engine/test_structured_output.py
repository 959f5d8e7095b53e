"""Structured output in the engine library, on a tiny random-weight model that speaks the default
model's tokenizer (its vocabulary size, its tokenizer.json): masks allow exactly what the grammar
allows, EOS only where it is complete, matchers follow the output tokens, compiled grammars are
cached, bad constraints are refused by name, and JSON-schema outputs of greedy and seeded
requests validate through chunked prefill and preemption."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig

from common.config import EngineConfig
from common.default_model import gguf_path
from common.sampling_params import SamplingParams, StructuredOutput
from engine import structured_output
from engine.core.request import Request
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.grammar import validate_sampling_params
from engine.sampler import Sampler
from engine.structured_output import StructuredOutputManager
from structured_schemas import Person
from tiny_models import SMALL, make_checkpoint

VOCAB = 49152  # SmolLM2's
EOS = 2


PERSON = StructuredOutput(json=Person.model_json_schema())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    directory = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    make_checkpoint(
        directory,
        LlamaConfig,
        dict(
            SMALL,
            vocab_size=VOCAB,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=1,
            eos_token_id=EOS,
        ),
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def make_engine(model_dir, **overrides) -> LLMEngine:
    args = dict(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    return LLMEngine(EngineConfig(**{**args, **overrides}))


def allowed_ids(engine: LLMEngine, request: Request) -> set[int]:
    disallowed = engine.executor.structured.disallowed([request], [0])
    assert disallowed.shape == (1, VOCAB) and disallowed.dtype == torch.bool
    return set(torch.nonzero(~disallowed[0]).flatten().tolist())


def constrained(request_id: str, constraint: StructuredOutput, **params) -> Request:
    return Request(request_id, [1, 9, 9], SamplingParams(structured_output=constraint, **params))


def run(engine: LLMEngine) -> dict[str, tuple[list[int], str]]:
    """Every request to its end: (output tokens, finish reason)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason.value
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def test_masks_allow_what_the_grammar_allows_and_eos_only_when_complete(engine, tokenizer):
    request = constrained("digits", StructuredOutput(regex=r"[0-9]{2,3}"))
    engine.executor.structured.add(request)
    first = allowed_ids(engine, request)
    # SmolLM2 writes numbers one digit per token: exactly the ten digits may start.
    assert {tokenizer.decode([t]) for t in first} == set("0123456789")
    assert EOS not in first
    for expected_eos, digit in ((False, "4"), (True, "2")):
        request.append_output(tokenizer.token_to_id(digit))
        assert not engine.executor.structured.advance(request)
        assert (EOS in allowed_ids(engine, request)) is expected_eos
    request.append_output(tokenizer.token_to_id("7"))
    assert engine.executor.structured.advance(request)  # three digits: nothing may follow
    assert allowed_ids(engine, request) == {EOS}
    engine.executor.structured.release(request)


def test_a_drafting_request_gets_the_grammars_mask_after_each_draft(engine, tokenizer):
    """Speculative drafts: one mask row per verified row, the matcher stepped through the
    drafts and back; a row past a draft that ends the grammar (EOS) allows everything (its
    token is never kept), however the buffer was used before; an unconstrained request beside
    it gets rows with nothing forbidden."""
    structured = engine.executor.structured
    one, two = tokenizer.token_to_id("1"), tokenizer.token_to_id("2")
    digits = set(tokenizer.token_to_id(d) for d in "0123456789")
    request = constrained("drafts", StructuredOutput(regex=r"[0-9]{2}"))
    free = Request("free", [1, 9, 9], SamplingParams())
    free.spec_token_ids = [5]
    structured.add(request)
    for drafts in ([one, two, EOS], [one, two]):
        structured.disallowed([request, free], [0])  # the buffer holds other rows first
        request.spec_token_ids = drafts
        disallowed = structured.disallowed([free, request], [1])
        assert disallowed.shape == (2 + 1 + len(drafts), VOCAB)
        allowed = [set(torch.nonzero(~row).flatten().tolist()) for row in disallowed]
        assert allowed[0] == allowed[1] == set(range(VOCAB))  # the unconstrained rows
        assert allowed[2] == allowed[3] == digits and allowed[4] == {EOS}
        assert allowed[5:] == [set(range(VOCAB))] * (len(drafts) - 2)
    request.spec_token_ids = []
    assert allowed_ids(engine, request) == digits  # the matcher stepped back
    structured.release(request)


def test_matchers_are_per_request_and_compiled_grammars_cached(engine, tokenizer):
    choice = StructuredOutput(choice=["yes", "no"])
    assert engine.executor.structured.compile(choice) is engine.executor.structured.compile(
        StructuredOutput(choice=("yes", "no"))
    )
    assert engine.executor.structured.compile(choice) is not engine.executor.structured.compile(
        StructuredOutput(choice=["no", "yes"])
    )
    a, b = constrained("a", choice), constrained("b", choice)
    engine.executor.structured.add(a)
    engine.executor.structured.add(b)
    start = allowed_ids(engine, a)
    a.append_output(tokenizer.token_to_id("yes"))
    assert engine.executor.structured.advance(a)
    assert allowed_ids(engine, a) == {EOS}
    assert allowed_ids(engine, b) == start  # b's matcher did not move
    # A request the manager never saw (as a copy of a running one would be) catches up.
    late = constrained("late", choice)
    late.append_output(tokenizer.token_to_id("no"))
    assert engine.executor.structured.advance(late)
    for request in (a, b, late):
        engine.executor.structured.release(request)


def test_only_constrained_rows_get_a_mask(engine, tokenizer):
    free = Request("free", [1, 2, 3], SamplingParams())
    # Nothing constrained: no work at all.
    assert engine.executor.structured.start_masks([free]) is None
    request = constrained("c", StructuredOutput(json_object=True))
    engine.executor.structured.add(request)
    disallowed = engine.executor.structured.start_masks([free, request, free]).result()
    assert disallowed.shape == (3, VOCAB)
    assert not disallowed[[0, 2]].any()
    assert torch.equal(disallowed[1], engine.executor.structured.disallowed([request], [0])[0])
    starts = torch.nonzero(~disallowed[1]).flatten().tolist()
    assert starts and all(tokenizer.decode([t]).startswith("{") for t in starts)
    engine.executor.structured.release(request)


def test_sampler_applies_the_mask_before_sampling_and_keeps_raw_logprobs():
    vocab = 10
    sampler = Sampler(vocab, [EOS])
    logits = torch.arange(vocab, dtype=torch.float32).repeat(3, 1)
    requests = [
        Request("greedy", [1], SamplingParams(temperature=0.0, logprobs=1)),
        Request("free", [1], SamplingParams(temperature=0.0)),
        Request("seeded", [1], SamplingParams(temperature=1.0, seed=3, top_k=2)),
    ]
    disallowed = torch.ones(3, vocab, dtype=torch.bool)
    disallowed[0, 4] = False
    disallowed[1] = False
    disallowed[2, [1, 2]] = False
    for _ in range(5):
        out = sampler.sample(logits, requests, disallowed)
        assert out.token_ids[:2] == [4, 9] and out.token_ids[2] in (1, 2)
    assert out.logprobs[0][1][0][0] == 9  # logprobs are the model's, before the mask
    assert torch.equal(logits, torch.arange(vocab, dtype=torch.float32).repeat(3, 1))


@pytest.mark.parametrize(
    "constraint, message",
    [
        (StructuredOutput(regex="a(b"), "structured_output has an invalid regular expression"),
        (
            StructuredOutput(json='{"type": "nonsense"}'),
            "structured_output has an invalid JSON schema",
        ),
        (StructuredOutput(json="{not json"), "structured_output has an invalid JSON schema"),
        (
            StructuredOutput(grammar="start: missing_rule"),
            "structured_output has an invalid grammar",
        ),
        (StructuredOutput(choice=[]), "structured_output.choice must be a non-empty list"),
        (StructuredOutput(), "structured_output must set exactly one of"),
        (StructuredOutput(regex="a", choice=["a"]), "got regex and choice"),
    ],
)
def test_bad_constraints_are_refused_by_name(engine, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_sampling_params(SamplingParams(structured_output=constraint))
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=constraint))
    assert not engine.requests and not engine.has_unfinished


def test_the_tokenizer_is_built_at_the_first_constrained_request_only(model_dir, monkeypatch):
    """llguidance's tokenizer (about a second of start-up, holding the interpreter lock) is
    built once, when a constrained request first needs it: not for an engine that serves none."""
    builds = []
    build = structured_output._load_tokenizer

    def counted(*args):
        builds.append(args)
        return build(*args)

    monkeypatch.setattr(structured_output, "_load_tokenizer", counted)
    engine = make_engine(model_dir)
    engine.add_request("free", [1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished:
        engine.step()
    assert builds == []
    for rid in ("a", "b"):
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=2, structured_output=PERSON))
    while engine.has_unfinished:
        engine.step()
    assert len(builds) == 1


def test_a_model_without_tokenizer_json_refuses_structured_output(tmp_path):
    make_checkpoint(
        tmp_path, LlamaConfig, dict(SMALL, num_attention_heads=4, num_key_value_heads=2)
    )
    engine = make_engine(tmp_path)
    with pytest.raises(InvalidRequestError, match=r"tokenizer\.json"):
        engine.add_request("r", [1, 2, 3], SamplingParams(structured_output=PERSON))


def test_a_tokenizer_llguidance_cannot_read_is_named_to_each_request_and_logged_once(
    tmp_path, caplog
):
    make_checkpoint(
        tmp_path, LlamaConfig, dict(SMALL, num_attention_heads=4, num_key_value_heads=2)
    )
    (tmp_path / "tokenizer.json").write_text("{not json")
    engine = make_engine(tmp_path)
    for rid in ("a", "b"):
        with pytest.raises(InvalidRequestError, match="structured_output is not available"):
            engine.add_request(rid, [1, 2, 3], SamplingParams(structured_output=PERSON))
    failures = [r for r in caplog.records if "structured output's tokenizer" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert not engine.requests and not engine.has_unfinished


def test_a_gguf_file_gives_the_masks_of_its_directory_twin(default_model_dir, tokenizer):
    """The default model is served from its GGUF file: llguidance's tokenizer comes from the
    file's metadata and masks exactly as the prepared directory's tokenizer.json does, before
    and after the output's first tokens."""
    opening = tokenizer.encode('{"', add_special_tokens=False).ids
    masks = []
    for model_path in (gguf_path(), default_model_dir):
        manager = StructuredOutputManager(model_path, VOCAB, [EOS])
        request = constrained("r", PERSON)
        manager.add(request)
        first = manager.disallowed([request], [0])
        assert not first[0, opening[0]]  # the schema's object may open here
        request.output_token_ids.extend(opening)
        masks.append((first, manager.disallowed([request], [0])))
    (file_first, file_next), (dir_first, dir_next) = masks
    assert 0 < int((~file_next).sum()) < VOCAB
    assert torch.equal(file_first, dir_first) and torch.equal(file_next, dir_next)


def test_json_schema_outputs_validate_through_chunked_prefill_and_preemption(model_dir, tokenizer):
    # 24 blocks of 4 hold 96 tokens; five requests of 40 prompt tokens need far more, and a
    # 32-token budget prefills each prompt in two chunks.
    engine = make_engine(model_dir, num_kv_blocks=24)
    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    params = {
        f"seeded-{i}": SamplingParams(
            temperature=1.0, seed=i, max_tokens=56, structured_output=PERSON
        )
        for i in range(4)
    }
    params["greedy"] = SamplingParams(temperature=0.0, max_tokens=56, structured_output=PERSON)
    for request_id, p in params.items():
        engine.add_request(request_id, prompt, p)
    results = run(engine)
    assert engine.scheduler.num_preemptions > 0
    for request_id, (tokens, reason) in results.items():
        text = tokenizer.decode(tokens)
        assert reason == "stop", (request_id, text)
        assert EOS not in tokens  # the grammar ended it: no EOS needed
        Person.model_validate(json.loads(text))
    assert not engine.executor.structured._states  # every matcher released

    # A seeded request reproduces itself alone, without preemption.
    alone = make_engine(model_dir)
    alone.add_request("again", prompt, params["seeded-0"])
    assert run(alone)["again"][0] == results["seeded-0"][0]


def test_the_grammar_ends_the_request_despite_ignore_eos_and_min_tokens(engine, tokenizer):
    engine.add_request(
        "r",
        [1, 9, 9],
        SamplingParams(
            temperature=1.0,
            seed=1,
            ignore_eos=True,
            min_tokens=10,
            max_tokens=20,
            structured_output=StructuredOutput(choice=["yes", "no"]),
        ),
    )
    tokens, reason = run(engine)["r"]
    assert reason == "stop" and tokenizer.decode(tokens) in ("yes", "no")
    # A grammar that allows nothing but EOS ends at once, min_tokens notwithstanding.
    engine.add_request(
        "empty",
        [1, 9, 9],
        SamplingParams(temperature=1.0, min_tokens=5, structured_output=StructuredOutput(regex="")),
    )
    assert run(engine)["empty"] == ([EOS], "stop")


def test_each_sample_of_an_n_request_follows_the_grammar(engine, tokenizer):
    engine.add_request(
        "n",
        [1, 9, 9],
        SamplingParams(
            n=3,
            temperature=1.0,
            seed=5,
            max_tokens=8,
            structured_output=StructuredOutput(regex=r"(ab|cd)[0-9]"),
        ),
    )
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    assert sorted(tokens) == [0, 1, 2]
    for sample in tokens.values():
        assert re.fullmatch(r"(ab|cd)[0-9]", tokenizer.decode(sample))
