"""Incremental detokenization of a stream of generated token ids, with stop strings.

Turns token ids into text deltas as soon as the text is certain: never half a UTF-8 character
(byte-level tokens can split one), never text that might still turn out to be the start of a
stop string. The deltas of one stream concatenate to exactly `tokenizer.decode(output_ids)` (up
to a matched stop string). It decodes a bounded window of recent tokens, never the whole
sequence. It must never import transformers or touch a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


def bad_token_id(token_ids: Sequence[int], tokenizer: Tokenizer) -> str | None:
    """Why `token_ids` cannot be decoded, or None. tokenizers silently decodes an unknown id to
    nothing; an id outside the vocabulary must not vanish."""
    for token_id in token_ids:
        if not 0 <= token_id < tokenizer.vocab_size:
            return (
                f"token_ids contains {token_id}, outside the vocabulary [0, {tokenizer.vocab_size})"
            )
    return None


@dataclass
class DetokenizerDelta:
    """Text that became certain with the latest tokens; stop_matched is the stop string that
    ended it."""

    text: str
    stop_matched: str | None = None


class IncrementalDetokenizer:
    """Detokenizes one output stream.

    Token window: `ids[prefix:read]` was already turned into text; decoding `ids[prefix:]` and
    cutting off the text of `ids[prefix:read]` yields the new text with the same leading-space
    handling the decoder applies inside a longer sequence. Both offsets move forward after each
    emission, so each step decodes only the tokens since the previous-but-one emission (the
    window only grows while the text keeps ending inside an unfinished character).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        # Certain text not yet emitted because it could be the start of a stop string.
        self._held = ""
        self.stop_matched: str | None = None

    @property
    def finished(self) -> bool:
        return self.stop_matched is not None

    def push(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Add generated tokens; return the text that is now certain."""
        if self.finished:
            return DetokenizerDelta("")
        self._ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def finish(self) -> DetokenizerDelta:
        """The stream ended: flush everything held back (incomplete characters decode as U+FFFD)."""
        if self.finished:
            return DetokenizerDelta("")
        return self._release(self._decode_new(final=True), final=True)

    def advance(self, token_ids: Sequence[int], finish: bool = False) -> DetokenizerDelta:
        """push; with `finish` (the generation ended with these tokens) also flush what is held
        back, unless a stop string matched. The text one message of a stream makes certain."""
        delta = self.push(token_ids)
        if finish and delta.stop_matched is None:
            delta.text += self.finish().text
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        if not final and self._ends_in_byte_fallback_run():
            return ""
        text = self._decode(self._ids[self._prefix :])
        # A trailing U+FFFD is (almost always) a character whose remaining bytes are in tokens
        # still to come; wait for them unless the stream has ended.
        if len(text) <= len(self._prefix_text) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        new = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return new

    def _ends_in_byte_fallback_run(self) -> bool:
        # The next byte token may make the whole run invalid UTF-8, which turns even its complete
        # characters into U+FFFD: text from a run is only certain once the run has ended.
        byte_ids = self._tokenizer.byte_fallback_ids
        if not byte_ids:
            return False
        skipped = self._tokenizer.special_token_ids if self._skip_special_tokens else frozenset()
        last = next((i for i in reversed(self._ids) if i not in skipped), None)
        return last in byte_ids

    def _release(self, new_text: str, final: bool) -> DetokenizerDelta:
        # Every possible stop match starts inside the held text or the new text (see _hold_length).
        text = self._held + new_text
        match = self._earliest_stop(text)
        if match is not None:
            stop, start = match
            self.stop_matched = stop
            self._held = ""
            return DetokenizerDelta(
                text[: start + len(stop) if self._include_stop else start], stop
            )
        keep = 0 if final else self._hold_length(text)
        self._held = text[len(text) - keep :]
        return DetokenizerDelta(text[: len(text) - keep])

    def _earliest_stop(self, text: str) -> tuple[str, int] | None:
        # The stop that completes first in the text, so the result does not depend on how the
        # tokens were chunked; on a tie the longer one (it started earlier).
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                best = key if best is None or key < best else best
        return None if best is None else (best[2], best[1])

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
