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

On a mesh the pool is split over `data` like the global one: replica r (slots r * S/D ...)
owns block r of D equal blocks, `S/D * R + 1` pages each, the first page of each block a
spare (block 0's is NULL_PAGE), so every ring a replica's slots use lies on its devices::

    max_slots = 4, R = 3, D = 2  ->  pool of 2 * (2 * 3 + 1) = 14 pages
    block 0: [0=NULL | slot 0: 1 2 3 | slot 1: 4 5 6]   block 1: [7 | slot 2: 8 9 10 | slot 3: 11 12 13]

Prefix caching: a hit's shared pages hold the global layers' K/V only; a ring starts empty. The
request resumes `hit_recompute` tokens (rounded to pages) before the hit's end so its rings
receive exact keys, and the global layers drop their writes into the shared pages meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv.pages import NULL_PAGE, WriteIndices


def ring_pages(window: int, max_chunk: int, page_size: int) -> int:
    """Pages a slot's ring needs: a step's queries (up to `max_chunk` of them, the first at the
    sequence's cached length L) see keys from L - window + 1 to L + max_chunk - 1."""
    return -(-(window - 1 + max_chunk) // page_size) + 1


def hit_recompute(windows: Sequence[int | None]) -> int:
    """Tokens before the end H of a prefix-cache hit that a request must recompute, so that
    its rings hold exact keys for every query from H on: the sum of W - 1 over the windowed
    layers (`windows`: each layer's window, None for a global one).

    The cached pages give the global layers exact K/V for every position < H, but a new
    request's rings start empty. Recomputing from S, a windowed layer's K/V at position t is
    exact once the hidden state feeding it is, and a windowed layer's output at t is exact once
    its keys t - W + 1 ... t are: each windowed layer pushes the first exact position W - 1
    further (a global layer reads the cached K/V, exact, and pushes nothing). So the queries
    from H on see exact keys in every layer iff S + sum(W - 1) <= H. One window (W' = W rounded
    to pages) is not enough with two windowed layers or more::

        2 windowed layers, W = 4, H = 16, S = 12: layer 0's keys 12..15 are exact, but its
        outputs at 12..14 miss keys 9..11, so layer 1's keys 13..15, which query 16 reads, are not.

    The recomputed positions below H are in shared pages: the global layers must not write
    them there (`TokenGroup.shared`), since their values there are not exact."""
    return sum(w - 1 for w in windows if w is not None)


def ring_pool_pages(max_slots: int, ring: int, replicas: int = 1) -> int:
    """Pages of the windowed layers' pool: `replicas` blocks of max_slots / replicas rings and a
    spare page each (module docstring); `max_slots * ring + 1` on one device."""
    if max_slots % replicas:
        raise ValueError(f"max_slots={max_slots} is not divisible by {replicas} data replicas")
    return replicas * (max_slots // replicas * ring + 1)


def ring_tables(max_slots: int, ring: int, replicas: int = 1) -> np.ndarray:
    """i32[max_slots, ring]: the pages of each slot's ring in the windowed layers' pool of
    `ring_pool_pages(max_slots, ring, replicas)` pages: slot s of replica r = s // (max_slots /
    replicas) owns `ring` pages of block r, after its spare page (NULL_PAGE in block 0)."""
    per_replica = max_slots // replicas
    slot = np.arange(max_slots, dtype=np.int32)
    first = (slot // per_replica) * (per_replica * ring + 1) + NULL_PAGE + 1 + (slot % per_replica) * ring  # [max_slots]
    return first[:, None] + np.arange(ring, dtype=np.int32)[None, :]


def ring_indices(idx: WriteIndices, tables: jax.Array, page_size: int, num_pages: int) -> WriteIndices:
    """A step's write indices (`paged_state.write_indices`) as the windowed layers see them:
    tokens land in ring page (cache_index // page_size) % R, and attention reads the rotated
    view with shifted positions (module docstring). Padding tokens (cache_index >= new
    length) get page id `num_pages` (out of bounds: dropped).

    tables: i32[max_slots, R] (`ring_tables`); num_pages: the ring pool's size (`ring_pool_pages`)."""
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
        page_ids=jnp.where(valid, page_ids, num_pages),
        offsets=idx.offsets,
        cache_index=idx.cache_index - shift,
        new_lengths=idx.new_lengths - shift[:, 0],
    )
