"""A GGUF's tokenizer read from its metadata without transformers equals transformers' GGUF
tokenizer (the oracle): on the default model's GGUF (SmolLM2: byte-level BPE, "smollm"
pre-tokenizer), on a copy of its vocabulary with Llama 3's split and BOS added, and on a
SentencePiece vocabulary (Llama 2's kind) learned here; a tokenizer kind Folio does not read
(T5's unigram, another split) is refused naming the key."""

from __future__ import annotations

import itertools
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
        ("tokenizer.ggml.model 't5'", {"tokenizer.ggml.model": "t5"}),
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


# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
CORPUS = "the cat sat on the mat. the cats ate the rat; naive caf\u00e9 at 10:30 on the 2nd"


def sentencepiece_vocabulary(merges: int) -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece BPE vocabulary as llama.cpp writes one (Llama 2's layout: <unk>,
    <s>, </s>, the 256 byte tokens, then pieces best-scored first), learned here from CORPUS by
    merging the most frequent pair of pieces `merges` times."""
    words = [[*("\u2581" + w)] for w in CORPUS.split(" ")]
    pieces = sorted({c for w in words for c in w})
    for _ in range(merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in itertools.pairwise(w):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        pieces.append(best[0] + best[1])
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i : i + 2] = [best[0] + best[1]]
                i += 1
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    # Merged pieces score above single characters, later merges lower (as SentencePiece's).
    singles = [p for p in pieces if len(p) == 1]
    merged = [p for p in pieces if len(p) > 1]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256)]
    scores += [-float(i) for i in range(len(merged))]
    scores += [-1000.0 - i for i in range(len(singles))]
    types = [UNKNOWN, CONTROL, CONTROL, *([BYTE] * 256)] + [NORMAL] * len(pieces)
    return tokens + merged + singles, scores, types


@pytest.mark.parametrize("listed_merges", [False, True], ids=["scores", "merges"])
def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path, listed_merges):
    """tokenizer.ggml.model 'llama' (Llama 2's, Mistral's): BPE over the pieces with byte
    fallback for what no piece spells (the accents, the digits here), merges from the scores or
    as the file lists them; BOS added by default, decoded back to the text."""
    tokens, scores, types = sentencepiece_vocabulary(40)
    path = tmp_path / "spm.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", scores)
    writer.add_array("tokenizer.ggml.token_type", types)
    if listed_merges:  # in the reverse of the scores' order: the file's win
        pieces = set(tokens)
        merges = [
            next(f"{t[:i]} {t[i:]}" for i in range(1, len(t)) if {t[:i], t[i:]} <= pieces)
            for t in tokens[259:]
            if len(t) > 1
        ]
        writer.add_array("tokenizer.ggml.merges", merges[::-1])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    writer.add_uint32("llama.context_length", 512)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = Tokenizer.from_dir(path)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [CORPUS, "the cat ate", " the  mat ", "caf\u00e9 \U0001f642 at 12", "Zebra!"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ids[0] == 1
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    assert len(ours.encode("the cat sat")) < len("the cat sat")  # pieces, not bytes
    assert ours.vocab_size == len(reference)


def test_gemma_s_sentencepiece_vocabulary_is_refused(tmp_path):
    writer = GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=re.escape("tokenizer.ggml.model 'llama' of a gemma3")):
        Tokenizer.from_dir(tmp_path / "g.gguf")
