"""Identities of KV blocks for prefix caching: chained hashes over full pages of tokens.

    root    = H(cache identity: model, cache format, page size)
    h_0     = H(root, salt,  tokens[0 : P])
    h_i     = H(h_{i-1},     tokens[i*P : (i+1)*P])

A block's hash names every token before it, the execution conditions and the tenant's
salt, so equal hashes mean the page's KV is exactly reusable; different salts never meet
(their chains differ from the first block on). SHA-256 makes a collision, which would
hand one request another's KV, practically impossible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def cache_identity(*parts: object) -> bytes:
    """The root of every chain: whatever must match for KV to be reusable."""
    return hashlib.sha256(repr(parts).encode()).digest()


def block_hashes(tokens: Sequence[int], page_size: int, root: bytes, salt: str | None = None) -> list[bytes]:
    """One hash per *full* page of `tokens` (a trailing partial page has none)."""
    parent = hashlib.sha256(root + b"salt:" + repr(salt).encode()).digest()
    out = []
    ids = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(ids) - page_size + 1, page_size):
        parent = hashlib.sha256(parent + ids[start : start + page_size].tobytes()).digest()
        out.append(parent)
    return out
