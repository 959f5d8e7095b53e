"""The ngram proposer (prompt lookup): drafts the tokens that followed the most recent earlier
occurrence of the request's last n tokens, in its own prompt and output.

The longest n in [prompt_lookup_min, prompt_lookup_max] with a match wins; a match nearer the
end wins among equals (recent text is likelier to repeat). Pure function over token ids, numpy
only: it never sees the model, and drafts nothing when nothing matches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(
    token_ids: Sequence[int] | np.ndarray, num_tokens: int, min_n: int, max_n: int
) -> list[int]:
    """Up to `num_tokens` drafted tokens continuing `token_ids`; [] when no n-gram matches."""
    length = len(token_ids)
    if num_tokens <= 0 or length <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Every earlier occurrence of an n-gram ending the text ends in an earlier occurrence of
    # its last token, before the last position (a continuation must follow it): one pass finds
    # those, then how far back each agrees with the text's end (one step runs this for every
    # drafting request, so no pass per n).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if not len(ends):
        return []
    depth = np.arange(min(max_n, length - 1))
    back = ends[:, None] - depth
    agree = (back >= 0) & (tokens[np.maximum(back, 0)] == tokens[length - 1 - depth])
    matched = np.cumprod(agree, axis=1).sum(axis=1)
    longest = int(matched.max())
    if longest < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == longest)[-1]])
    return tokens[end + 1 : end + 1 + num_tokens].tolist()
