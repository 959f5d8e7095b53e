"""A GGUF's tokenizer read from its metadata without transformers equals transformers' GGUF
tokenizer (the oracle): on the default model's GGUF (SmolLM2: byte-level BPE, "smollm"
pre-tokenizer), and on a copy of its vocabulary with Llama 3's split and BOS added; a
tokenizer kind Folio does not read (SentencePiece's, another split) is refused naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter
from transformers import AutoTokenizer

from common import default_model
from common.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! 12345 apples cost $3.50.",
    "  leading spaces\n\nnew lines\ttabs  ",
    "naïve café — 東京 🙂 <|im_start|>user\nhi<|im_end|>",
    "I'm sure they'll've done it; 2024-12-01T19:30Z",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 17 * 23?"},
]


def rewritten(source: Path, target: Path, **overrides: object) -> Path:
    """The metadata of `source` (no tensors) with `overrides` (GGUF key -> value)."""
    writer = GGUFWriter(str(target), "llama")
    for field in GGUFReader(source).fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = overrides.pop(field.name, field.contents())
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    assert not overrides, overrides
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def check_against_transformers(path: Path) -> None:
    ours = Tokenizer.from_dir(path)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    assert ours.vocab_size == len(reference)
    assert ours.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in ours.eos_token_ids
    assert ours.chat_template == reference.chat_template
    assert ours.encode_chat(MESSAGES) == reference.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.fixture(scope="module")
def gguf_source() -> Path:
    return default_model.gguf_path()


def test_the_default_model_s_gguf_tokenizes_as_transformers_does(gguf_source):
    check_against_transformers(gguf_source)
    assert Tokenizer.from_dir(gguf_source).max_model_len == 8192


def test_llama3_s_split_and_an_added_bos(tmp_path, gguf_source):
    path = rewritten(
        gguf_source,
        tmp_path / "llama3.gguf",
        **{"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": True},
    )
    check_against_transformers(path)
    assert Tokenizer.from_dir(path).encode("hi")[0] == 1  # SmolLM2's BOS, <|im_start|>


@pytest.mark.parametrize(
    ("key", "metadata"),
    [
        ("tokenizer.ggml.model 'llama'", {"tokenizer.ggml.model": "llama"}),
        (
            "tokenizer.ggml.pre 'qwen2'",
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"},
        ),
    ],
)
def test_a_tokenizer_folio_does_not_read_is_refused(tmp_path, key, metadata):
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for name, value in metadata.items():
        writer.add_string(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=re.escape(key)):
        Tokenizer.from_dir(tmp_path / "t.gguf")
