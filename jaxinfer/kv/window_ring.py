"""Bounded pages for the sliding-window layers of a hybrid model (Gemma 2/3, gpt-oss, Qwen2 with
`layer_types`): memory per layer type.

A global layer needs every token a sequence has seen; a layer with window W only the last
W - 1 keys before each query. So the windowed layers keep a pool of their own in which each
slot owns a *ring* of R pages, R just large enough for any step (a chunk of up to T tokens:
`ring_pages`); logical page p of a sequence lives in ring page p % R. The global layers keep
the engine's ordinary pool and block tables. Memory for windowed layers is therefore
`max_slots * R` pages whatever the context, and their attention gathers R pages, so its
width never grows with the context either::

    W = 6, page_size = 4, T = 4  ->  R = ceil((6 - 1 + 4) / 4) + 1 = 4 pages per slot
    logical pages   0  1  2  3  4  5  6        (a sequence of 27 tokens, 26 cached + 1 new)
    ring page       0  1  2  3  0  1  2        (p % R; pages 0-2 overwritten by 4-6)
    view            [3  4  5  6] = ring [3 0 1 2]   first = 6 - 4 + 1 = 3

Attention reads the ring through a *view*: the R ring pages rotated so that view page i
holds logical page `first + i`, with the lengths and query positions shifted down by
`first * page_size`. Attention only compares positions (causal, window, length masks) and
keys were rotated by their true positions when written, so the shifted view gives the same
result; keys before `first` are behind every query's window (R's sizing). Whatever a ring
page held before (an earlier logical page, a previous request of the slot) is at a view
position no query may see, and the masks replace it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv.pages import NULL_PAGE, WriteIndices


def ring_pages(window: int, max_chunk: int, page_size: int) -> int:
    """Pages a slot's ring needs: a step's queries (up to `max_chunk` of them, the first at the
    sequence's cached length L) see keys from L - window + 1 to L + max_chunk - 1."""
    return -(-(window - 1 + max_chunk) // page_size) + 1


def ring_tables(max_slots: int, ring: int) -> np.ndarray:
    """i32[max_slots, ring]: slot s owns pages 1 + s * ring ... (s + 1) * ring of the windowed
    layers' pool (of `max_slots * ring + 1` pages; NULL_PAGE stays reserved)."""
    return (NULL_PAGE + 1 + np.arange(max_slots * ring, dtype=np.int32)).reshape(max_slots, ring)


def ring_indices(idx: WriteIndices, tables: jax.Array, page_size: int) -> WriteIndices:
    """A step's write indices (`paged_state.write_indices`) as the windowed layers see them:
    tokens land in ring page (cache_index // page_size) % R, and attention reads the rotated
    view with shifted positions (module docstring). Padding tokens (cache_index >= new
    length) get page id `num_ring_pages` (out of bounds: dropped).

    tables: i32[max_slots, R] (`ring_tables`)."""
    ring = tables.shape[1]
    rows = tables[idx.slots]  # [B, R]
    first = jnp.maximum((idx.new_lengths - 1) // page_size - ring + 1, 0)  # [B]: oldest logical page in view
    view = jnp.take_along_axis(rows, (first[:, None] + jnp.arange(ring, dtype=jnp.int32)) % ring, axis=1)
    page_ids = jnp.take_along_axis(rows, (idx.cache_index // page_size) % ring, axis=1)  # [B, T]
    valid = idx.cache_index < idx.new_lengths[:, None]
    shift = (first * page_size)[:, None]  # [B, 1]
    return WriteIndices(
        slots=idx.slots,
        block_tables=view,
        page_ids=jnp.where(valid, page_ids, tables.size + 1),
        offsets=idx.offsets,
        cache_index=idx.cache_index - shift,
        new_lengths=idx.new_lengths - shift[:, 0],
    )
