"""The ngram proposer (prompt lookup): drafts the tokens that followed the most recent earlier
occurrence of the request's last n tokens, in its own prompt and output.

The longest n in [prompt_lookup_min, prompt_lookup_max] with a match wins; a match nearer the
end wins among equals (recent text is likelier to repeat). Pure function over token ids, numpy
only: it never sees the model, and drafts nothing when nothing matches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` drafted tokens continuing `token_ids`; [] when no n-gram matches."""
    length = len(token_ids)
    if num_tokens <= 0 or length <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # Windows starting at 0 .. length - n - 1: every occurrence before the suffix itself.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []
