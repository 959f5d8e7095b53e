"""The offline API and the CLI on the default model: prompt forms, per-prompt params,
streaming equals the whole text, chat, and the `folio` commands of the README."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError

FOLIO = str(Path(sys.executable).with_name("folio"))


@pytest.fixture(scope="module")
def llm(default_model_dir):
    # Without prefix caching, two runs of the same prompts compute the same batch shapes, so
    # even bfloat16 results repeat exactly (a cache hit changes shapes and rounding).
    return LLM(model=str(default_model_dir), enable_prefix_caching=False)


def test_strings_and_token_ids_give_the_same_result(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    text = "The three primary colors are"
    by_text, by_ids = llm.generate([text, llm.tokenizer.encode(text)], params)
    assert by_text.token_ids == by_ids.token_ids and by_text.text == by_ids.text
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids)
    (single,) = llm.generate(text, params)
    assert single.token_ids == by_text.token_ids
    assert by_text.finish_reason in ("stop", "length")


def test_one_params_per_prompt(llm):
    outs = llm.generate(
        ["Hello", "Count to ten:"],
        [
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        ],
    )
    assert [len(o.token_ids) for o in outs] == [3, 7]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    with pytest.raises(InvalidRequestError, match="2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["a"], SamplingParams(top_p=2.0))


def test_stream_concatenates_to_the_whole_text(llm):
    prompts = ["Write a sentence with an emoji and some 日本語.", "List fruits:"]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=40)
    whole = llm.generate(prompts, params)
    texts = ["", ""]
    tokens: list[list[int]] = [[], []]
    finish = [None, None]
    for delta in llm.generate_stream(prompts, params):
        texts[delta.index] += delta.text
        tokens[delta.index] += delta.token_ids
        if delta.finished:
            finish[delta.index] = delta.finish_reason
    assert texts == [llm.tokenizer.decode(t) for t in tokens]
    assert tokens == [w.token_ids for w in whole]
    assert texts == [w.text for w in whole]
    assert finish == [w.finish_reason for w in whole]


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))
    assert "Paris" in out.text
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(messages)


def test_chat_continues_a_final_message(llm):
    started = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    (out,) = llm.chat(started, params, add_generation_prompt=False, continue_final_message=True)
    prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert "Paris" in out.text
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        llm.chat(started, params, continue_final_message=True)


def test_cli_prepare_model_prints_the_directory_last(default_model_dir):
    result = subprocess.run([FOLIO, "prepare-model"], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == str(default_model_dir)


def test_cli_chat_streams_an_answer(default_model_dir):
    result = subprocess.run(
        [
            FOLIO,
            "chat",
            "Say hello.",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--model",
            str(default_model_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_cli_refuses_a_bad_model_path(tmp_path):
    result = subprocess.run(
        [FOLIO, "chat", "hi", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "nope" in result.stderr
