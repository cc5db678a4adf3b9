"""`bad_words` (vLLM's sampling parameter): words a request may never write.

Each word is tokenized as it would open the text and, where that gives other tokens, after a
space: the word at the start and in the middle of a text (vLLM keeps the second form only when
it has as many tokens as the first, so " oblique" in one token escapes a ban of "oblique" that
opens the text in two; here it does not).
Before each sampled token, a word whose tokens but the last end the request's output so far
has its last token masked (a one-token word is masked always). Only the output counts, not the
prompt, as in vLLM.

`BadWords` follows a request's tokens on the host and gives the step its mask, with the same
methods as a structured-output matcher (`jaxinfer.structured_output.GrammarMatcher`), so the
engine sends it through the grammar's bitmask input; `AllOf` joins it to a grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jaxinfer.structured_output import BITS, allows, bitmask_words
from jaxinfer.tokenizer import Tokenizer


class TokenConstraint(Protocol):
    """What the engine asks of a request's host-side mask (a grammar, bad words, both)."""

    def allowed(self) -> np.ndarray: ...  # i32[W]: packed bitmask of the tokens allowed next
    def consume(self, token: int) -> None: ...
    @property
    def done(self) -> bool: ...  # the request's output is complete (a finished grammar)
    def draft_masks(self, drafts: Sequence[int]) -> np.ndarray: ...  # i32[n <= len(drafts), W]


def bad_word_ids(tokenizer: Tokenizer, words: Sequence[str], vocab: int) -> list[tuple[int, ...]]:
    """The token sequences `words` forbid: each alone and after a space."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ValueError(f"bad_words: {word!r} has no tokens")
        sequences.append(bare)
        if spaced != bare:
            sequences.append(spaced)
    if outside := sorted({t for seq in sequences for t in seq if t >= vocab}):
        raise ValueError(f"bad_words: token ids {outside[:5]} are outside the vocabulary [0, {vocab})")
    return sequences


class BadWords:
    """One request's bad words, following its output."""

    def __init__(self, sequences: Sequence[tuple[int, ...]], vocab: int) -> None:
        self._sequences = tuple(sequences)
        self._reach = max(map(len, self._sequences)) - 1  # output tokens a prefix can span
        self._tail: tuple[int, ...] = ()  # the output's last `_reach` tokens
        self._free = np.full(bitmask_words(vocab), -1, np.int32)  # i32[W]

    def allowed(self) -> np.ndarray:
        return self._mask(self._tail)

    def consume(self, token: int) -> None:
        self._tail = self._extended(self._tail, token)

    @property
    def done(self) -> bool:
        return False  # bad words never end a request

    def draft_masks(self, drafts: Sequence[int]) -> np.ndarray:
        """Row j: what may follow drafts[: j + 1]; stops before the first draft a bad word forbids."""
        tail, masks = self._tail, [np.zeros((0, len(self._free)), np.int32)]
        for token in drafts:
            if not allows(self._mask(tail), token):
                break
            tail = self._extended(tail, token)
            masks.append(self._mask(tail)[None])
        return np.concatenate(masks)

    def _extended(self, tail: tuple[int, ...], token: int) -> tuple[int, ...]:
        return (*tail, int(token))[-self._reach:] if self._reach else ()

    def _mask(self, tail: tuple[int, ...]) -> np.ndarray:
        mask = self._free
        for seq in self._sequences:
            prefix = seq[:-1]
            if not prefix or tail[-len(prefix):] == prefix:
                if mask is self._free:
                    mask = mask.copy()
                mask.view(np.uint32)[seq[-1] // BITS] &= ~np.uint32(1 << seq[-1] % BITS)
        return mask


class AllOf:
    """Two constraints at once (a grammar and bad words): a token must pass both."""

    def __init__(self, first: TokenConstraint, second: TokenConstraint) -> None:
        self.first, self.second = first, second

    def allowed(self) -> np.ndarray:
        return self.first.allowed() & self.second.allowed()

    def consume(self, token: int) -> None:
        self.first.consume(token)
        self.second.consume(token)

    @property
    def done(self) -> bool:
        return self.first.done or self.second.done

    def draft_masks(self, drafts: Sequence[int]) -> np.ndarray:
        a, b = self.first.draft_masks(drafts), self.second.draft_masks(drafts)
        n = min(len(a), len(b))
        return a[:n] & b[:n]
