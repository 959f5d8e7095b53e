"""The prepared default model is the bundled GGUF, bit for bit, in a plain Hugging Face
directory."""

import fcntl
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import default_model
from common.default_model import model_name, prepare_default_model, resolve_model_path

TEXTS = [
    "The capital of France is",
    "  leading spaces, tabs\tand\nnewlines",
    "héllo wörld 😀 世界 <|im_end|> after a special token",
]


@pytest.fixture(scope="module")
def gguf_source() -> Path:
    return default_model.gguf_path()


def test_logits_equal_the_gguf_model(default_model_dir: Path, gguf_source: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_source.parent, gguf_file=gguf_source.name, dtype=torch.float32
    )
    prepared = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    assert type(prepared) is type(reference)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    input_ids = AutoTokenizer.from_pretrained(default_model_dir)(
        prompt, return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        expected = reference(input_ids).logits
        actual = prepared(input_ids).logits
    assert torch.equal(actual, expected)


def test_directory_is_plain_hugging_face(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    with safe_open(default_model_dir / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    # Tied embeddings are stored once, under the input embedding's name.
    assert config["tie_word_embeddings"] and "lm_head.weight" not in names
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model_dir / name).is_file(), name


def test_saved_tokenizer_equals_the_gguf_tokenizer(
    default_model_dir: Path, gguf_source: Path
) -> None:
    reference = AutoTokenizer.from_pretrained(gguf_source.parent, gguf_file=gguf_source.name)
    saved = AutoTokenizer.from_pretrained(default_model_dir)
    for text in TEXTS:
        assert saved(text).input_ids == reference(text).input_ids, text
    messages = [{"role": "user", "content": "Hi there"}]
    assert saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert saved.special_tokens_map == reference.special_tokens_map


def test_second_prepare_reuses_the_directory(default_model_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()}
    assert prepare_default_model() == default_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()} == before


def test_prepare_waits_for_a_concurrent_preparation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))
    target = default_model.default_model_dir()
    target.parent.mkdir(parents=True)
    results: list[Path] = []
    with open(default_model.lock_path(), "w") as lock:
        # Play the other process: hold the lock while "converting", then publish a complete
        # directory.
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: results.append(prepare_default_model()))
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive(), "prepare_default_model did not wait for the lock"
        target.mkdir()
        (target / default_model.COMPLETE_MARKER).write_text("done\n")
    waiter.join(timeout=30)
    # It reused the published directory instead of converting again (that would take seconds
    # and write model.safetensors).
    assert results == [target]
    assert sorted(p.name for p in target.iterdir()) == [default_model.COMPLETE_MARKER]


def test_resolve_model_path(default_model_dir: Path, gguf_source: Path, tmp_path: Path) -> None:
    # The default model is served from the wheel's file as it is; an engine the file cannot
    # serve as it is gets the directory prepared from it. Both go by the default model's name.
    assert resolve_model_path(None) == gguf_source
    assert resolve_model_path(None, file_as_is=False) == default_model_dir
    assert model_name(gguf_source) == model_name(default_model_dir) == "SmolLM2-135M-Instruct"
    assert model_name(tmp_path / "other.gguf") == "other.gguf"
    assert resolve_model_path(str(default_model_dir)) == default_model_dir

    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=str(missing)):
        resolve_model_path(str(missing))
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model_path(str(tmp_path))
    a_file = tmp_path / "config.json"
    with pytest.raises(ValueError, match="not an existing directory"):
        resolve_model_path(str(a_file))
