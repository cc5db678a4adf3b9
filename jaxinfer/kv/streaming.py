"""A bounded StreamingLLM cache: S attention sinks + a ring of the W most recent tokens.

A streaming slot owns `pages_for(page_size)` pages for its whole life, however long the
sequence runs. Token i (logical index, counting every token the sequence has seen) lives
at cache slot::

    slot(i) = i                       if i < S      (the sinks, never evicted)
            = S + (i - S) % W         otherwise     (the ring: token i evicts token i - W)

    S = 2, W = 4, after 9 tokens:   cache slot   0 1 | 2 3 4 5
                                    holds token  0 1 | 6 7 8 5     (tokens 2..4 evicted)

Keys are stored before RoPE; attention rotates them by their position inside the cache
(`jaxinfer.attention.reference.streaming_attention_reference`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.kv.pages import NULL_PAGE, WriteIndices


@dataclasses.dataclass(frozen=True)
class StreamingSpec:
    num_sinks: int  # S: the first tokens, kept for good
    window: int  # W: the most recent tokens (the query's own included)

    def __post_init__(self) -> None:
        if not isinstance(self.num_sinks, int) or self.num_sinks < 0:
            raise ValueError(f"num_sinks={self.num_sinks!r} must be a non-negative integer")
        if not isinstance(self.window, int) or self.window <= 0:
            raise ValueError(f"window={self.window!r} must be a positive integer")

    @property
    def capacity(self) -> int:
        """Token slots a sequence ever occupies: S + W."""
        return self.num_sinks + self.window

    def pages_for(self, page_size: int) -> int:
        """Pages a streaming slot owns (allocated once, never grown)."""
        return -(-self.capacity // page_size)


def ring_slot(spec: StreamingSpec, index: jax.Array) -> jax.Array:
    """Cache slot of the token with logical index `index` (any int array shape)."""
    s = spec.num_sinks
    return jnp.where(index < s, index, s + (index - s) % spec.window)


def ring_logical_index(spec: StreamingSpec, cached: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each cache slot of each sequence: the logical index of the token it holds, and
    whether it holds one -> (i32[B, S + W], bool[B, S + W]). `cached`: i32[B] tokens seen.

    Ring slot S + r holds the newest token i <= cached - 1 with (i - S) % W == r.
    """
    s, w = spec.num_sinks, spec.window
    slot = jnp.arange(spec.capacity, dtype=jnp.int32)[None, :]
    behind = cached[:, None] - 1 - slot  # for ring slots: how far the newest token is past slot's first use
    ring_index = slot + w * jnp.floor_divide(behind, w)
    index = jnp.where(slot < s, slot, ring_index)
    valid = jnp.where(slot < s, slot < cached[:, None], behind >= 0)
    return index, valid


def ring_write_indices(idx: WriteIndices, spec: StreamingSpec, num_new: jax.Array, page_size: int,
                       num_pages: int) -> WriteIndices:
    """Logical write indices (`jaxinfer.kv.paged_state.write_indices`) -> a ring's: each row's
    new tokens land at `ring_slot` of their index.

    `cache_index` stays the logical index (the attention needs it). Of the tokens a row
    writes in one step, a recent token is dropped when a later token of the same step
    takes its slot (only the last W survive), so no two writes hit the same slot.
    The rows' block tables come back exactly `spec.pages_for(page_size)` wide: a narrower
    table (a short sequence in a narrow context bucket) is padded with NULL_PAGE.
    """
    pages = spec.pages_for(page_size)
    tables = idx.block_tables[:, :pages]
    tables = jnp.pad(tables, ((0, 0), (0, pages - tables.shape[1])), constant_values=NULL_PAGE)
    index = idx.cache_index
    t = jnp.arange(index.shape[1], dtype=jnp.int32)[None, :]
    keep = (t < num_new[:, None]) & ((index < spec.num_sinks) | (index >= idx.new_lengths[:, None] - spec.window))
    slot = ring_slot(spec, index)
    page_ids = jnp.take_along_axis(tables, slot // page_size, axis=1)
    valid = keep & (page_ids != NULL_PAGE)
    return dataclasses.replace(idx, block_tables=tables, page_ids=jnp.where(valid, page_ids, num_pages),
                               offsets=slot % page_size)
