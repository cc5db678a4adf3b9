"""N-gram drafts (prompt lookup): proposed on the host, from a request's own tokens.

Deterministic, so q is one-hot: the engine hands the tokens to the step as
`DraftBatch.tokens` and the step passes `Proposal(tokens, q=None)` to verification.

`propose_ngram` searches a whole sequence (O(L) per call: the reference). The engine keeps
an `NgramIndex` per request instead: an n-gram -> latest position dict updated as tokens
append, and a pointer into the copied text that it follows while the drafts keep being
accepted, so a decoding step's host work is O(1) in the sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class NgramIndex:
    """Incremental prompt lookup over one growing sequence.

    `search(k)` proposes exactly what `propose_ngram(tokens, k, ngram_max, ngram_min)` does
    (with `prompt_first`, an occurrence inside the first `prompt_len` tokens wins over a later
    one in the output at the same n). `propose(k)` first continues the last match: while every
    token appended since equals the token the matched text had there (the drafts were accepted,
    and so was the bonus token), the next draft is simply what follows in the matched text.
    Otherwise it searches again. Drafts shorter than k come from a fresh short match: see
    `propose`.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 2, prompt_len: int = 0, prompt_first: bool = False,
                 short_draft: int | None = None):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.prompt_len, self.prompt_first = prompt_len, prompt_first
        self.short_draft = short_draft
        self.tokens: list[int] = []
        # n -> {n-gram: where the tokens after its latest occurrence start}; an n-gram enters
        # once a token follows it (an occurrence must end before the last token)
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self._in_prompt: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._latest}
        self._next: int | None = None  # where the followed match continues: tokens[_next] is the next draft

    def __len__(self) -> int:
        return len(self.tokens)

    def sync(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """Append whatever of prompt + generated the index has not seen (O(new tokens))."""
        seen = len(self.tokens)
        if seen < len(prompt):
            self.extend(prompt[seen:])
            seen = len(prompt)
        self.extend(generated[seen - len(prompt):])

    def extend(self, new: Sequence[int]) -> None:
        for token in new:
            self._append(int(token))

    def _append(self, token: int) -> None:
        tokens = self.tokens
        if self._next is not None:  # still copying? (tokens[_next] < len: the match lies behind)
            self._next = self._next + 1 if tokens[self._next] == token else None
        position = len(tokens)  # the new token's; the n-grams ending just before it now have a follower
        for n, table in self._latest.items():
            if position >= n:
                key = tuple(tokens[position - n : position])
                table[key] = position
                if position < self.prompt_len:
                    self._in_prompt[n][key] = position
        tokens.append(token)

    def lookup(self) -> tuple[int, int] | None:
        """(where the tokens after the best occurrence start, its n) or None."""
        length = len(self.tokens)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            key = tuple(self.tokens[length - n :])
            start = self._in_prompt[n].get(key) if self.prompt_first else None
            if start is None:
                start = self._latest[n].get(key)
            if start is not None:
                return start, n
        return None

    def search(self, k: int) -> list[int]:
        """A fresh lookup, ignoring the followed match (== `propose_ngram` unless prompt_first)."""
        found = self.lookup()
        return [] if found is None else self.tokens[found[0] : found[0] + k]

    def propose(self, k: int) -> list[int]:
        """Up to k drafts: the followed match's continuation, else a fresh lookup (which the
        next steps then follow). A fresh match shorter than ngram_max proposes at most
        `short_draft` tokens: short matches are wrong more often, and a narrower verify
        block is cheaper."""
        if self._next is not None:
            return self.tokens[self._next : self._next + k]
        found = self.lookup()
        if found is None:
            return []
        start, n = found
        self._next = start
        if n < self.ngram_max and self.short_draft is not None:
            k = min(k, self.short_draft)
        return self.tokens[start : start + k]
