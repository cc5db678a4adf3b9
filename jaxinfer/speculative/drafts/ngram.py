"""N-gram drafts (prompt lookup): proposed on the host, from a request's own tokens.

Deterministic, so q is one-hot: the engine hands the tokens to the step as
`DraftBatch.tokens` and the step passes `Proposal(tokens, q=None)` to verification.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, ngram_max: int = 3, ngram_min: int = 1) -> np.ndarray:
    """Prompt lookup: up to k tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (longest n first). i32[L] -> i32[<= k]; empty if none::

        tokens = [a b c d a b]   n = 2: "a b" occurred at 0, followed by [c d a b] -> propose [c d ...]
    """
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # start i covers i..i+n-1 < L-1
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = hits[-1] + n
            return tokens[start : start + k]
    return tokens[:0]
