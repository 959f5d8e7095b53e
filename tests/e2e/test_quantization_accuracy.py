"""Accuracy of --quantization on the default model, measured: perplexity on a local text (the
Apache License 2.0, about 2,200 scored tokens, tests/fixtures/perplexity_text.txt) within 2% of
the unquantized model's for int8 and 6% for int4, through the whole offline engine."""

from __future__ import annotations

import pytest

from bench.perplexity import DEFAULT_TEXT, perplexity, token_logprobs
from engine.llm import LLM

MAX_INCREASE = {"int8": 0.02, "int4": 0.06}


def score(model_dir, quantization: str | None) -> tuple[float, int]:
    llm = LLM(str(model_dir), dtype="auto", quantization=quantization, max_num_seqs=8)
    logprobs = token_logprobs(llm, llm.tokenizer.encode(DEFAULT_TEXT.read_text()))
    return perplexity(logprobs), len(logprobs)


@pytest.fixture(scope="module")
def unquantized(default_model_dir) -> tuple[float, int]:
    return score(default_model_dir, None)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_perplexity_stays_within_bounds(default_model_dir, unquantized, method):
    reference, count = unquantized
    assert count > 2000
    quantized, quantized_count = score(default_model_dir, method)
    increase = quantized / reference - 1
    print(f"perplexity: unquantized {reference:.4f}, {method} {quantized:.4f} ({increase:+.2%})")
    assert quantized_count == count
    assert quantized != reference  # the quantized weights were really used
    assert increase <= MAX_INCREASE[method], (method, reference, quantized)
