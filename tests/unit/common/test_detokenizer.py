"""IncrementalDetokenizer: streamed deltas add up to the full decode, stop strings cut it right."""

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from common.tokenizer import Tokenizer

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def sp_tokenizer(sentencepiece_style_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(sentencepiece_style_tokenizer_dir)


def partial_character_ids(tokenizer: Tokenizer) -> list[int]:
    """Tokens that hold only part of a UTF-8 character (they decode to U+FFFD on their own)."""
    return [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]


@pytest.fixture(scope="module")
def partial_ids(tokenizer: Tokenizer) -> list[int]:
    return partial_character_ids(tokenizer)


def stream(
    detokenizer: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = (1,)
) -> list[DetokenizerDelta]:
    """Push ids in chunks of the given sizes (cycled), then finish."""
    deltas, i, k = [], 0, 0
    while i < len(ids):
        size = chunk_sizes[k % len(chunk_sizes)]
        deltas.append(detokenizer.push(ids[i : i + size]))
        i, k = i + size, k + 1
    deltas.append(detokenizer.finish())
    return deltas


def check_stream_equals_decode(
    tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int], skip_special_tokens: bool
) -> None:
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = stream(detokenizer, ids, chunk_sizes)
    for delta in deltas:
        delta.text.encode("utf-8")  # no lone surrogates
        assert "\ufffd" not in delta.text or "\ufffd" in expected
        assert delta.stop_matched is None
    assert "".join(d.text for d in deltas) == expected


def id_lists(vocab_size: int, *favoured: list[int]) -> st.SearchStrategy[list[int]]:
    """Ids from the whole vocabulary, each favoured group as likely as all the rest together."""
    groups = [st.integers(0, vocab_size - 1)] + [st.sampled_from(ids) for ids in favoured]
    return st.lists(st.one_of(groups), max_size=40)


chunks = st.lists(st.integers(1, 5), min_size=1, max_size=8)


@FUZZ
@given(data=st.data(), chunk_sizes=chunks, skip=st.booleans())
def test_fuzz_byte_level_stream_equals_decode(
    tokenizer: Tokenizer,
    partial_ids: list[int],
    data: st.DataObject,
    chunk_sizes: list[int],
    skip: bool,
) -> None:
    ids = data.draw(id_lists(tokenizer.vocab_size, partial_ids))
    check_stream_equals_decode(tokenizer, ids, chunk_sizes, skip)


@FUZZ
@given(data=st.data(), chunk_sizes=chunks, skip=st.booleans())
def test_fuzz_sentencepiece_style_stream_equals_decode(
    sp_tokenizer: Tokenizer, data: st.DataObject, chunk_sizes: list[int], skip: bool
) -> None:
    # Byte-fallback tokens <0x..> split characters; tokens starting with ▁ carry the leading
    # space that the decoder strips from the first token only.
    tokens = [sp_tokenizer.id_to_token(i) for i in range(sp_tokenizer.vocab_size)]
    byte_ids = [i for i, t in enumerate(tokens) if t.startswith("<0x")]
    space_ids = [i for i, t in enumerate(tokens) if t.startswith("▁")]
    ids = data.draw(id_lists(sp_tokenizer.vocab_size, byte_ids, space_ids))
    check_stream_equals_decode(sp_tokenizer, ids, chunk_sizes, skip)


TEXTS = [
    "Emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧 done.",
    "中文文本，日本語のテキスト、한국어 텍스트",  # noqa: RUF001 (the fullwidth comma is the point)
    " leading space, ¿Qué tal? Ελληνικά\n\tnew line",
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_streamed_token_by_token_is_reproduced(
    tokenizer: Tokenizer, sp_tokenizer: Tokenizer, text: str
) -> None:
    for tok in (tokenizer, sp_tokenizer):
        ids = tok.encode(text, add_special_tokens=False)
        deltas = stream(IncrementalDetokenizer(tok), ids)
        assert all("\ufffd" not in d.text for d in deltas)
        assert "".join(d.text for d in deltas) == tok.decode(ids)
    assert (
        "".join(d.text for d in stream(IncrementalDetokenizer(tokenizer), tokenizer.encode(text)))
        == text
    )


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_emitted_as_soon_as_it_is_complete(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = ""
    for n in range(1, len(ids) + 1):
        emitted += detokenizer.push(ids[n - 1 : n]).text
        # Reference: the decode of the longest token prefix that does not end inside a character.
        m = max(k for k in range(n + 1) if not tokenizer.decode(ids[:k]).endswith("\ufffd"))
        assert emitted == tokenizer.decode(ids[:m])


# ---- stop strings ---------------------------------------------------------------------------


def reference_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Plain loop: the first position in the text where some stop string has just completed."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def run_with_stops(
    tokenizer: Tokenizer,
    text: str,
    stops: Sequence[str],
    include: bool = False,
    chunk_sizes: Sequence[int] = (1,),
) -> tuple[list[DetokenizerDelta], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, stop=stops, include_stop_str_in_output=include)
    return stream(
        detokenizer, tokenizer.encode(text, add_special_tokens=False), chunk_sizes
    ), detokenizer


def joined(deltas: list[DetokenizerDelta]) -> str:
    return "".join(d.text for d in deltas)


def matched(deltas: list[DetokenizerDelta]) -> list[str]:
    return [d.stop_matched for d in deltas if d.stop_matched is not None]


def test_stop_inside_one_token(tokenizer: Tokenizer) -> None:
    text = "Hello wonderful world"
    assert " wonderful" in [tokenizer.decode([i]) for i in tokenizer.encode(text)]
    deltas, detokenizer = run_with_stops(tokenizer, text, ["onder"])
    assert joined(deltas) == "Hello w"
    assert matched(deltas) == ["onder"] and detokenizer.stop_matched == "onder"


def test_stop_split_across_tokens(tokenizer: Tokenizer) -> None:
    deltas, _ = run_with_stops(tokenizer, "Hello wonderful world", ["lo won"])
    assert joined(deltas) == "Hel"
    assert matched(deltas) == ["lo won"]


def test_stop_split_inside_a_multibyte_character(tokenizer: Tokenizer) -> None:
    text = "I like 😀 a lot"
    deltas, _ = run_with_stops(tokenizer, text, ["😀 a"], include=True)
    assert joined(deltas) == "I like 😀 a"
    assert matched(deltas) == ["😀 a"]


def test_partial_match_is_held_then_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world!", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=[" world peace"])
    texts = [detokenizer.push([i]).text for i in ids]
    # " world" could be the start of the stop string, so it waits for the next token ("!").
    assert texts[0] == "Hello" and texts[1] == "" and texts[2] == " world!"
    assert joined([DetokenizerDelta(t) for t in texts] + [detokenizer.finish()]) == "Hello world!"
    assert detokenizer.stop_matched is None


def test_finish_releases_a_held_partial_match(tokenizer: Tokenizer) -> None:
    deltas, detokenizer = run_with_stops(tokenizer, "Hello world", [" world peace"])
    assert deltas[-1].text == " world"
    assert joined(deltas) == "Hello world" and detokenizer.stop_matched is None


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    deltas, _ = run_with_stops(tokenizer, "Hello wonderful world", ["wonder"], include=True)
    assert joined(deltas) == "Hello wonder"


def test_earliest_stop_wins(tokenizer: Tokenizer) -> None:
    text = "one two three four"
    for stops in (["four", "two", "three"], ["three", "two"]):
        deltas, _ = run_with_stops(tokenizer, text, stops)
        assert joined(deltas) == "one " and matched(deltas) == ["two"]


def test_pushes_after_a_stop_are_ignored(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["."])
    first = detokenizer.push(tokenizer.encode("Done. More", add_special_tokens=False))
    assert (first.text, first.stop_matched) == ("Done", ".")
    assert detokenizer.push(tokenizer.encode(" text")) == DetokenizerDelta("")
    assert detokenizer.finish() == DetokenizerDelta("")


def test_stop_strings_must_not_be_empty(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, stop=["ok", ""])


PIECES = ["a", "b", "ab", " ", "😀", "界", "é", "\n", "ba", "aa"]


@FUZZ
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=25),
    stop_pieces=st.lists(st.lists(st.sampled_from(PIECES), min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
    chunk_sizes=chunks,
)
def test_fuzz_stop_strings_match_the_reference(
    tokenizer: Tokenizer,
    pieces: list[str],
    stop_pieces: list[list[str]],
    include: bool,
    chunk_sizes: list[int],
) -> None:
    text = "".join(pieces)
    stops = ["".join(p) for p in stop_pieces]
    deltas, detokenizer = run_with_stops(tokenizer, text, stops, include, chunk_sizes)
    expected_text, expected_stop = reference_stop(text, stops, include)
    assert joined(deltas) == expected_text
    assert detokenizer.stop_matched == expected_stop
    assert matched(deltas) == ([expected_stop] if expected_stop else [])
