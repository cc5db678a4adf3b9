"""Page addressing: the pool's fixed sizes, where a step's tokens land, and gathers by block table.

A sequence's cache is a list of logical blocks of `page_size` tokens; its row of the
block table names the physical page holding each block::

    block_tables[slot] = [7, 2, 9, NULL_PAGE, ...]     page_size = 4, lengths[slot] = 10
    logical token:   0 1 2 3 | 4 5 6 7 | 8 9 . .
    physical page:   7       | 2       | 9 (half full)

Page `NULL_PAGE` is never handed out by the allocator: unused block-table entries point
at it, and every read of it is masked because it lies beyond the sequence length.

Every cache format (`jaxinfer.kv.layer_cache`) builds on this module and nothing else of `kv`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

NULL_PAGE = 0  # reserved physical page; block-table entries with no page point here


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Fixed sizes of the paged cache, chosen once per engine."""

    num_pages: int  # physical pages in the pool, including the reserved NULL_PAGE
    page_size: int  # tokens per page
    max_slots: int  # sequences that can be resident at once
    max_pages_per_seq: int  # block-table width; bounds a sequence at max_seq_len tokens

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_slots", "max_pages_per_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page {NULL_PAGE} is reserved)")

    @property
    def max_seq_len(self) -> int:
        return self.page_size * self.max_pages_per_seq

    @classmethod
    def for_batch(cls, max_slots: int, max_seq_len: int, page_size: int = 16) -> KVCacheSpec:
        """A pool just large enough for `max_slots` sequences of `max_seq_len` tokens."""
        pages_per_seq = -(-max_seq_len // page_size)
        return cls(
            num_pages=max_slots * pages_per_seq + 1,
            page_size=page_size,
            max_slots=max_slots,
            max_pages_per_seq=pages_per_seq,
        )


@struct.dataclass
class WriteIndices:
    """Where one token group's new tokens land; computed once per forward, shared by all layers."""

    slots: jax.Array  # i32[B]: the cache slot of each row
    block_tables: jax.Array  # i32[B, max_pages_per_seq]: the rows' block tables
    page_ids: jax.Array  # i32[B, T]; == num_pages (out of bounds, dropped) for padding
    offsets: jax.Array  # i32[B, T]: position within the page
    cache_index: jax.Array  # i32[B, T]: logical position of each new token in its sequence
    new_lengths: jax.Array  # i32[B]: the rows' cache lengths after this step


def drop_writes_below(idx: WriteIndices, start: jax.Array, num_pages: int) -> WriteIndices:
    """`idx` with the writes of tokens at cache positions < start[b] dropped (page id
    `num_pages`, out of bounds), as padding's are; reads are unchanged. start: i32[B]."""
    return dataclasses.replace(idx, page_ids=jnp.where(idx.cache_index < start[:, None], num_pages, idx.page_ids))


def block_table_array(pages_per_slot: list[list[int]], max_pages_per_seq: int) -> np.ndarray:
    """Host helper: per-slot page lists -> i32[len(pages_per_slot), max_pages_per_seq]."""
    table = np.full((len(pages_per_slot), max_pages_per_seq), NULL_PAGE, np.int32)
    for slot, pages in enumerate(pages_per_slot):
        if len(pages) > max_pages_per_seq:
            raise ValueError(f"slot {slot} has {len(pages)} pages > {max_pages_per_seq=}")
        table[slot, : len(pages)] = pages
    return table


def at_layer(layer: jax.Array | None, *index) -> tuple:
    """An index into a cache leaf: `index`, or `(layer, *index)` into a leaf stacked over
    layers ([L, ...]: a layer cache viewed at one layer of its run, see `LayerCache`)."""
    return index if layer is None else (layer, *index)


def scatter_tokens(pages: jax.Array, new: jax.Array, idx: WriteIndices, layer: jax.Array | None = None) -> jax.Array:
    """Scatter new: [B, T, ...] into pages: [P, page_size, ...] (padding is dropped), or
    into layer `layer` of stacked pages [L, P, page_size, ...] (in place: no copy of the rest)."""
    return pages.at[at_layer(layer, idx.page_ids, idx.offsets)].set(new.astype(pages.dtype), mode="drop")


def gather_pages(pages: jax.Array, block_tables: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """pages: [P, page_size, ...] (or [L, P, page_size, ...] read at `layer`), block_tables:
    i32[B, n] -> [B, n * page_size, ...]."""
    gathered = pages[at_layer(layer, block_tables)]  # [B, n, page_size, ...]
    b, n, s = gathered.shape[:3]
    return gathered.reshape(b, n * s, *gathered.shape[3:])
