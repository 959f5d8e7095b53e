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


class SuffixIndex:
    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.max_depth = max_depth
        self._outputs: deque[np.ndarray] = deque(maxlen=max_requests)

    def finished(self, output_token_ids: Sequence[int]) -> None:
        """A finished request's output joins the window (the oldest leaves when it is full)."""
        if len(output_token_ids) > MIN_MATCH and self._outputs.maxlen:
            self._outputs.append(np.asarray(output_token_ids[-MAX_OUTPUT_TOKENS:], np.int64))

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafted tokens continuing `token_ids`; [] when nothing matches."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        if num_tokens <= 0 or len(tokens) <= MIN_MATCH:
            return []
        # The request's own tokens but its last (an occurrence must end before its suffix does).
        texts = [tokens[:-1], *self._outputs]
        candidates = self._continuations(tokens, texts, [tokens, *self._outputs], num_tokens)
        draft: list[int] = []
        while candidates and len(draft) < num_tokens:
            token = Counter(c[0] for c in candidates).most_common(1)[0][0]
            draft.append(token)
            candidates = [c[1:] for c in candidates if c[0] == token and len(c) > 1]
        return draft

    def _continuations(
        self,
        tokens: np.ndarray,
        texts: list[np.ndarray],
        sources: list[np.ndarray],
        num_tokens: int,
    ) -> list[tuple[int, ...]]:
        """The next `num_tokens` tokens (read in `sources`, each text's whole) after each
        occurrence in `texts` of the longest matching suffix."""
        pattern = tokens[-MIN_MATCH:]
        # Per text, the end positions (exclusive) of the occurrences matching so far.
        ends: list[np.ndarray] = []
        for text in texts:
            if len(text) < MIN_MATCH:
                ends.append(np.empty(0, dtype=np.int64))
                continue
            windows = np.lib.stride_tricks.sliding_window_view(text, MIN_MATCH)
            ends.append(np.flatnonzero((windows == pattern).all(axis=1)) + MIN_MATCH)
        if not any(len(e) for e in ends):
            return []
        depth = MIN_MATCH
        limit = min(self.max_depth, len(tokens))
        # Lengthen the match while some occurrence still agrees one token further back.
        while depth < limit:
            before = tokens[-depth - 1]
            longer = [
                e[(e - depth - 1 >= 0) & (text[np.maximum(e - depth - 1, 0)] == before)]
                for e, text in zip(ends, texts, strict=True)
            ]
            if not any(len(e) for e in longer):
                break
            ends, depth = longer, depth + 1
        out = []
        for e, source in zip(ends, sources, strict=True):
            for end in e.tolist():
                continuation = tuple(source[end : end + num_tokens].tolist())
                if continuation:
                    out.append(continuation)
        return out
