"""IncrementalDetokenizer fuzzed with hypothesis over the real tokenizers (the default model's
byte-level BPE, and a SentencePiece-style one with byte fallback): at every step the text
emitted so far is a prefix of the full decode of the tokens pushed so far and of all of them
at the end, so a piece is never taken back, never holds half a character, and never holds a
U+FFFD that the full decode does not have at the same place; at the end the pieces equal the
full decode.

Stronger than the fuzz in test_detokenizer.py (which checks only the end result): the prefix
property at every push, special tokens mixed in anywhere, and token sequences of real text in
any script cut at any token."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer

FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece_style"])
def tokenizer(
    request, default_model_dir: Path, sentencepiece_style_tokenizer_dir: Path
) -> Tokenizer:
    directory = {
        "byte_level": default_model_dir,
        "sentencepiece_style": sentencepiece_style_tokenizer_dir,
    }[request.param]
    return Tokenizer.from_dir(directory)


@pytest.fixture(scope="module")
def favoured_ids(tokenizer: Tokenizer) -> list[list[int]]:
    """Ids that are hard for a streaming decoder: parts of a UTF-8 character (byte-level
    pieces, <0xXX> byte fallback) and special tokens (kept or skipped)."""
    partial = [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]
    byte_fallback = sorted(tokenizer.byte_fallback_ids)
    special = sorted(tokenizer.special_token_ids)
    return [group for group in (partial, byte_fallback, special) if group]


# Every script, emoji with modifiers and joiners, control characters: whatever the tokenizer
# makes of them, cut at any token.
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)


def token_ids(tokenizer: Tokenizer, favoured: list[list[int]]) -> st.SearchStrategy[list[int]]:
    single = st.one_of(
        [st.integers(0, tokenizer.vocab_size - 1)] + [st.sampled_from(group) for group in favoured]
    ).map(lambda i: [i])
    text = any_text.map(lambda s: tokenizer.encode(s, add_special_tokens=False))
    return st.lists(st.one_of(single, text), max_size=12).map(
        lambda parts: [i for part in parts for i in part]
    )


def check_stream(
    tokenizer: Tokenizer, ids: list[int], cuts: list[int], skip_special_tokens: bool
) -> None:
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    emitted = ""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    for start, end in itertools.pairwise(bounds):
        delta = detokenizer.push(ids[start:end])
        assert delta.stop_matched is None
        delta.text.encode("utf-8")  # a str of whole characters: no lone surrogate
        emitted += delta.text
        assert expected.startswith(emitted), (ids[:end], emitted, expected)
    last = detokenizer.finish()
    last.text.encode("utf-8")
    assert emitted + last.text == expected


@FUZZ
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_streamed_pieces_are_always_a_prefix_of_the_full_decode(
    tokenizer: Tokenizer,
    favoured_ids: list[list[int]],
    data: st.DataObject,
    skip_special_tokens: bool,
) -> None:
    ids = data.draw(token_ids(tokenizer, favoured_ids), label="ids")
    cuts = data.draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=len(ids)), label="cuts")
    check_stream(tokenizer, ids, cuts, skip_special_tokens)
