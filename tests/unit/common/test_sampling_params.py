"""SamplingParams is plain data in the torch-free contract layer: importing it loads neither the
engine, nor torch, nor llguidance; its own checks name the parameter; the engine adds the
grammar check on top."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.sampling_params import SamplingParams, StructuredOutput
from engine.grammar import validate_sampling_params


def test_importing_sampling_params_loads_no_engine_torch_or_llguidance():
    code = (
        "import sys, common.sampling_params, common.sampling_proto; "
        "print(sorted(m for m in ('engine', 'torch', 'llguidance') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_shape_errors_are_caught_without_the_engine():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0).validate()
    with pytest.raises(ValueError, match="response_format must set exactly one of") as error:
        StructuredOutput(source="response_format").validate()
    assert error.value.param == "response_format"


def test_a_logit_bias_is_within_openais_range():
    SamplingParams(logit_bias={3: -100.0, 4: 100, 5: 0.5}).validate()
    for bias in (100.5, -101, 1e308):
        with pytest.raises(ValueError, match=r"logit_bias\[4\] must be in \[-100, 100\]"):
            SamplingParams(logit_bias={3: 1.0, 4: bias}).validate()


def test_token_limits_are_checked_by_name():
    SamplingParams(allowed_token_ids=[1, 2], bad_words_token_ids=[[3], [4, 5]]).validate(10)
    for params, problem in (
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(allowed_token_ids=[1, 10]), "allowed_token_ids contains token id 10"),
        (dict(bad_words_token_ids=[[3], []]), r"bad_words_token_ids\[1\] must be a non-empty"),
        (dict(bad_words_token_ids=[[3, -1]]), r"bad_words_token_ids\[0\] contains token id -1"),
        (dict(bad_words_token_ids=[[3]] * 513), "holds 513 sequences, over the limit of 512"),
    ):
        with pytest.raises(ValueError, match=problem):
            SamplingParams(**params).validate(10)


def test_a_repetition_penalty_is_one_float32_can_divide_by():
    SamplingParams(repetition_penalty=1e-5).validate()
    SamplingParams(repetition_penalty=1e300).validate()  # negative logits go to -inf: a ban
    for penalty in (0.0, -1.0, 1e-300, 9e-6):
        with pytest.raises(ValueError, match="repetition_penalty must be >= 1e-05"):
            SamplingParams(repetition_penalty=penalty).validate()


def test_a_grammar_that_does_not_compile_passes_the_shape_check_but_not_the_engine():
    params = SamplingParams(structured_output=StructuredOutput(regex="a(b"))
    params.validate()  # well formed: a string regex
    with pytest.raises(ValueError, match="structured_output has an invalid regular expression"):
        validate_sampling_params(params)


def test_the_source_labels_errors_but_is_not_part_of_the_constraint():
    labelled = StructuredOutput(regex="a(b", source="guided_regex")
    assert labelled == StructuredOutput(regex="a(b") and hash(labelled) == hash(
        StructuredOutput(regex="a(b")
    )
    with pytest.raises(ValueError, match=r"^guided_regex has an invalid regular expression") as e:
        validate_sampling_params(SamplingParams(structured_output=labelled))
    assert e.value.param == "guided_regex"
