"""The suffix proposer: drafts the most frequent continuation of the request's longest suffix
found in its own tokens and in recent requests' outputs (SuffixDecoding's idea, over a bounded
window of text rather than a persistent tree).

The longest suffix of the request's tokens (up to `max_depth` tokens, at least MIN_MATCH) that
occurs in the request before its end or in one of the last `max_requests` finished outputs
(each cut to its last MAX_OUTPUT_TOKENS tokens, so memory is bounded) gives the candidates: the
tokens that followed each occurrence. The draft follows them token by token, taking the most
frequent next token among those still agreeing with it. Pure function of token ids (numpy); it
never sees the model.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

import numpy as np

MIN_MATCH = 2
MAX_OUTPUT_TOKENS = 4096


# Between two outputs in the window's one array: no token equals it, so no match crosses it.
SEPARATOR = -1


class SuffixIndex:
    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.max_depth = max_depth
        self._outputs: deque[np.ndarray] = deque(maxlen=max_requests)
        # The window's outputs in one array, each followed by SEPARATOR (rebuilt when one
        # joins): a step searches it with one pass instead of one per output.
        self._window = np.empty(0, dtype=np.int64)

    def finished(self, output_token_ids: Sequence[int]) -> None:
        """A finished request's output joins the window (the oldest leaves when it is full)."""
        if len(output_token_ids) > MIN_MATCH and self._outputs.maxlen:
            self._outputs.append(np.asarray(output_token_ids[-MAX_OUTPUT_TOKENS:], np.int64))
            separator = np.array([SEPARATOR], dtype=np.int64)
            self._window = np.concatenate([part for o in self._outputs for part in (o, separator)])

    def propose(self, token_ids: Sequence[int] | np.ndarray, num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafted tokens continuing `token_ids`; [] when nothing matches."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        if num_tokens <= 0 or len(tokens) <= MIN_MATCH:
            return []
        # The request's own tokens but its last (an occurrence must end before its suffix
        # does), read on to its end; then the window.
        texts = [(tokens[:-1], tokens), (self._window, self._window)]
        candidates = self._continuations(tokens, texts, num_tokens)
        draft: list[int] = []
        while candidates and len(draft) < num_tokens:
            token = Counter(c[0] for c in candidates).most_common(1)[0][0]
            draft.append(token)
            candidates = [c[1:] for c in candidates if c[0] == token and len(c) > 1]
        return draft

    def _continuations(
        self, tokens: np.ndarray, texts: list[tuple[np.ndarray, np.ndarray]], num_tokens: int
    ) -> list[tuple[int, ...]]:
        """The next `num_tokens` tokens (read in each text's source, up to a SEPARATOR) after
        each occurrence in the texts of the longest matching suffix."""
        limit = min(self.max_depth, len(tokens))
        # The suffix read backwards: suffix[j] is the token j places before the last.
        suffix = tokens[::-1][:limit]
        matches: list[tuple[np.ndarray, np.ndarray]] = []  # per text: ends, match lengths
        for text, _ in texts:
            # Every occurrence ends in one of the last token: one pass finds those (a step runs
            # this for every drafting request, over the whole window), then how far back each
            # agrees with the suffix (at most `limit` tokens).
            ends = np.flatnonzero(text == suffix[0]) + 1
            if not len(ends):
                matches.append((ends, ends))
                continue
            back = ends[:, None] - 1 - np.arange(limit)
            agree = (back >= 0) & (text[np.maximum(back, 0)] == suffix)
            matches.append((ends, np.cumprod(agree, axis=1).sum(axis=1)))
        depth = max((int(lengths.max()) for _, lengths in matches if len(lengths)), default=0)
        if depth < MIN_MATCH:
            return []
        out = []
        for (ends, lengths), (_, source) in zip(matches, texts, strict=True):
            for end in ends[lengths == depth].tolist():
                continuation = source[end : end + num_tokens].tolist()
                if SEPARATOR in continuation:
                    continuation = continuation[: continuation.index(SEPARATOR)]
                if continuation:
                    out.append(tuple(continuation))
        return out
