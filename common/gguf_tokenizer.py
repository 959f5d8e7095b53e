"""A GGUF file's tokenizer, built from llama.cpp's tokenizer.ggml.* metadata with the `tokenizers`
library, so that a GGUF model is tokenized without transformers (which the serving processes
never import) and as transformers' GGUF tokenizer does (its tests are the oracle).

Byte-level BPE vocabularies (tokenizer.ggml.model "gpt2"), pre-tokenized as tokenizer.ggml.pre
says for the kinds in PRE_TOKENIZER_SPLITS, and SentencePiece ones ("llama": Llama 2's, Mistral's;
read as BPE over its pieces with byte fallback, the merges the file lists or, where it lists
none, the ones its pieces' scores imply, as transformers reads them); anything else is refused
naming the key and its value. This module never touches a device and never reads tensor data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as FastTokenizer

from common.gguf_file import read_gguf

# llama.cpp's token types that are added tokens rather than merges' products.
CONTROL, USER_DEFINED = 3, 4
# tokenizer.ggml.model values Folio reads.
TOKENIZER_KINDS = ("gpt2", "llama")
# SentencePiece's word-boundary marker, standing for a space.
SPACE = "\u2581"
# Llama 3's split (tiktoken's cl100k pattern), before the byte-level mapping.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split applied before the byte-level mapping; None: GPT-2's own (the
# byte-level pre-tokenizer's regex). transformers reads "smollm" with GPT-2's split, so Folio
# does too (the default model's prepared tokenizer.json came from it).
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "smollm": None,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
}
# tokenizer_config.json's special token names -> GGUF's id keys.
_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@dataclass
class GgufTokenizer:
    """What common.tokenizer.Tokenizer is built from, as a model directory's files give it."""

    fast: FastTokenizer
    tokenizer_config: dict[str, Any]  # special tokens' texts
    model_config: dict[str, Any]  # bos/eos ids and the context length
    chat_template: str | None


def read_gguf_tokenizer(path: str | Path) -> GgufTokenizer:
    meta = read_gguf(path).metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_KINDS:
        raise ValueError(
            f"GGUF {str(path)!r}: tokenizer.ggml.model {kind!r} is not read yet; Folio reads "
            "byte-level BPE ('gpt2') and SentencePiece ('llama') vocabularies"
        )
    arch = meta.get("general.architecture")
    if kind == "llama" and str(arch).startswith("gemma"):
        # Gemma's pieces spell runs of spaces as spaces and its merges follow the file's order,
        # not the scores (transformers has a reader of its own for them).
        raise ValueError(
            f"GGUF {str(path)!r}: tokenizer.ggml.model 'llama' of a {arch} file is not read yet "
            "(Gemma's SentencePiece vocabulary)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"GGUF {str(path)!r}: tokenizer.ggml.pre {pre!r} is not read yet; Folio reads "
            f"{', '.join(PRE_TOKENIZER_SPLITS)}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelled: set[str] | None
    if kind == "gpt2":
        fast, vocab, spelled = _byte_level(PRE_TOKENIZER_SPLITS[pre], meta, tokens)
    else:
        fast, vocab = _sentencepiece(meta, tokens)
        spelled = None
    # Control tokens stay whole as special tokens; in a byte-level vocabulary one spelled outside
    # the byte alphabet is a mislabel and left out, as transformers leaves it out. User-defined
    # ones stay whole too.
    fast.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind_ in zip(tokens, types, strict=True)
            if kind_ == CONTROL and (spelled is None or set(token) <= spelled)
        ]
    )
    fast.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind_ in zip(tokens, types, strict=True)
            if kind_ == USER_DEFINED and token in vocab
        ]
    )
    special = {
        name: tokens[meta[key]] for name, key in _SPECIAL_IDS.items() if meta.get(key) is not None
    }
    bos = special.get("bos_token")
    # A SentencePiece vocabulary that does not say otherwise gets BOS (as llama.cpp adds it).
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        fast.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, vocab[bos])]
        )
    model_config = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "max_position_embeddings": meta.get(f"{arch}.context_length"),
    }
    return GgufTokenizer(
        fast,
        special,
        {k: v for k, v in model_config.items() if v is not None},
        meta.get("tokenizer.chat_template"),
    )


def _byte_level(
    split: str | None, meta: dict[str, Any], tokens: list[str]
) -> tuple[FastTokenizer, dict[str, int], set[str]]:
    """A byte-level BPE vocabulary's tokenizer (`split` before the byte-level mapping: None for
    GPT-2's own), its vocabulary as spelled in the byte alphabet, and that alphabet."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A token outside the byte alphabet is spelled in it (as transformers does).
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode()): i
        for i, token in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    fast = FastTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    fast.pre_tokenizer = (
        byte_level
        if split is None
        else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    )
    fast.decoder = decoders.ByteLevel()
    return fast, vocab, spelled


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> tuple[FastTokenizer, dict[str, int]]:
    """A SentencePiece vocabulary's tokenizer (BPE over its pieces with byte fallback: its
    <0xXX> tokens; each word marked by SPACE and the text by a leading one) and vocabulary."""
    vocab = {token: i for i, token in enumerate(tokens)}
    listed = meta.get("tokenizer.ggml.merges")
    if listed:
        merges = [tuple(m.split(" ", 1)) for m in listed]
    else:
        merges = _implied_merges(tokens, meta["tokenizer.ggml.scores"])
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    fast = FastTokenizer(
        models.BPE(
            vocab,
            merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=tokens[unk_id] if unk_id is not None else None,
        )
    )
    fast.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first", split=False
    )
    fast.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return fast, vocab


def _implied_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a piece into two pieces,
    the best-scored product first (then the longer left part, then the longer right part), in
    vocabulary order otherwise."""
    ids = {token: i for i, token in enumerate(tokens)}
    pairs: list[tuple[float, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in ids and token[cut:] in ids
        ]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        pairs.extend((score, left, right) for left, right in splits)
    pairs.sort(key=lambda p: (-p[0], -len(p[1]), -len(p[2])))  # stable: ties keep their order
    return [(left, right) for _, left, right in pairs]


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves,
    the others for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + n) for n, b in enumerate(extra)},
    }
