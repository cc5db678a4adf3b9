"""The paged KV cache as an immutable, fixed-shape pytree.

A sequence's cache is a list of logical blocks of `page_size` tokens; its row of the
block table names the physical page holding each block::

    block_tables[slot] = [7, 2, 9, NULL_PAGE, ...]     page_size = 4, lengths[slot] = 10
    logical token:   0 1 2 3 | 4 5 6 7 | 8 9 . .
    physical page:   7       | 2       | 9 (half full)

Page `NULL_PAGE` is never handed out by the allocator: unused block-table entries point
at it, and every read of it is masked because it lies beyond the sequence length.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig
from jaxinfer.kv.formats import get_format
from jaxinfer.kv.plan import KVCacheArg, resolve_kv_cache

if TYPE_CHECKING:
    from jaxinfer.kv.streaming import StreamingSpec

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
class LayerKV:
    """One layer's full-precision K/V pages. Other cache formats (quantized, latent) are
    pytrees with the same two methods, so the forward does not care which it holds."""

    k: jax.Array  # [num_pages, page_size, n_kv_heads, head_dim]
    v: jax.Array  # [num_pages, page_size, n_kv_heads, head_dim]

    def write(self, k: jax.Array, v: jax.Array, idx: WriteIndices) -> LayerKV:
        """Scatter this step's k, v: [B, T, Hkv, Dh] to the slots named by `idx`."""
        return LayerKV(k=scatter_tokens(self.k, k, idx), v=scatter_tokens(self.v, v, idx))

    def gather(self, block_tables: jax.Array, lengths: jax.Array | None = None,
               slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Each sequence's pages in logical order: two [B, max_pages * page_size, Hkv, Dh].

        `lengths` (i32[B]) and `slots` (i32[B]) are unused here; formats that keep the page
        being filled outside the pool (`jaxinfer.kv.quantized.KiviLayerKV`) need them.
        """
        return gather_pages(self.k, block_tables), gather_pages(self.v, block_tables)


@struct.dataclass
class PagedKVState:
    layers: tuple[LayerKV, ...]  # one per model layer
    block_tables: jax.Array  # i32[max_slots, max_pages_per_seq]
    lengths: jax.Array  # i32[max_slots]: tokens already cached per slot
    # Static: None = logical block tables; a StreamingSpec = each slot is a bounded
    # StreamingLLM ring of sinks + recent tokens (`jaxinfer.kv.streaming`).
    streaming: StreamingSpec | None = struct.field(pytree_node=False, default=None)

    @property
    def num_pages(self) -> int:
        return jax.tree.leaves(self.layers[0])[0].shape[0]

    @property
    def page_size(self) -> int:
        return jax.tree.leaves(self.layers[0])[0].shape[1]

    @property
    def max_slots(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]


def init_paged_kv(config: ModelConfig, spec: KVCacheSpec, dtype=None,
                  streaming: StreamingSpec | None = None, kv_cache: KVCacheArg = "auto",
                  kv_head_copies: int = 1) -> PagedKVState:
    """An empty cache: zero pages, every block-table entry NULL_PAGE, every length 0.

    MLA models (`config.mla`) get `LatentKV` layers. `streaming` makes every slot a
    bounded sink + recent-token ring (its block table needs `streaming.pages_for(page_size)`
    pages). `kv_cache` picks the storage format: "auto" (`dtype`, full precision), a
    format name for every layer ("bf16", "int8", "fp8_e4m3", "int4", ...; see
    `jaxinfer.kv.formats`), a `KVCachePlan` or the path of a plan's JSON file.

    `kv_head_copies` r > 1 stores every KV head r times (stored head s holds KV head s // r)
    in the formats that split over a mesh's `model` axis (full precision, int8, fp8), so
    a `model` axis with more devices than KV heads still gives each device heads of its own
    (`jaxinfer.sharding.kv_head_copies`); the forward repeats K/V to match (`stored_kv_heads`).
    """
    if not isinstance(kv_head_copies, int) or kv_head_copies < 1:
        raise ValueError(f"kv_head_copies={kv_head_copies!r} must be a positive integer")
    if kv_head_copies > 1 and config.mla is not None:
        raise ValueError("MLA latent pages have no KV heads to copy (kv_head_copies must be 1)")
    if config.q_per_kv % kv_head_copies:
        raise ValueError(f"kv_head_copies={kv_head_copies} must divide the query heads per KV head "
                         f"({config.n_heads} / {config.n_kv_heads} = {config.q_per_kv}), or queries would read the wrong copy")
    dtype = jnp.dtype(dtype or config.dtype)
    if kv_cache != "auto" and (config.mla is not None or streaming is not None):
        _check_kv_cache_with(kv_cache, config, streaming)
    shape = (spec.num_pages, spec.page_size, config.n_kv_heads * kv_head_copies, config.head_dim)
    if config.mla is not None:
        from jaxinfer.kv.latent import LatentKV  # latent.py builds on this module

        if streaming is not None:
            raise ValueError("a streaming cache is not supported for MLA models")
        layers = tuple(LatentKV.zeros(config.mla, spec, dtype) for _ in range(config.n_layers))
    elif kv_cache == "auto":
        layers = tuple(LayerKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)) for _ in range(config.n_layers))
    else:
        from jaxinfer.kv.quantized import make_layer_kv  # quantized.py builds on this module

        formats = resolve_kv_cache(kv_cache, config.n_layers, dtype.name)
        layers = tuple(make_layer_kv(f, spec, config.n_kv_heads, config.head_dim, dtype, kv_head_copies) for f in formats)
    return PagedKVState(
        layers=layers,
        block_tables=jnp.full((spec.max_slots, spec.max_pages_per_seq), NULL_PAGE, jnp.int32),
        lengths=jnp.zeros((spec.max_slots,), jnp.int32),
        streaming=streaming,
    )


def stored_kv_heads(layer_kv) -> int:
    """KV heads a layer's pages hold (`n_kv_heads` times `kv_head_copies`): every per-head
    format's first leaf is `[num_pages, page_size, heads, ...]`."""
    return jax.tree.leaves(layer_kv)[0].shape[2]


def _check_kv_cache_with(kv_cache: KVCacheArg, config: ModelConfig, streaming: StreamingSpec | None) -> None:
    """Quantized formats need per-head K/V in logical pages: not MLA, and no KIVI in a ring."""
    if config.mla is not None:
        raise ValueError(f"kv_cache={kv_cache!r}: MLA models support only kv_cache='auto'")
    kivi = [f for f in resolve_kv_cache(kv_cache, config.n_layers, "float32") if get_format(f).has_tail]
    if kivi:
        raise ValueError(f"kv_cache={kv_cache!r}: the {kivi[0]!r} format cannot be used with a streaming cache")


def block_table_array(pages_per_slot: list[list[int]], max_pages_per_seq: int) -> np.ndarray:
    """Host helper: per-slot page lists -> i32[len(pages_per_slot), max_pages_per_seq]."""
    table = np.full((len(pages_per_slot), max_pages_per_seq), NULL_PAGE, np.int32)
    for slot, pages in enumerate(pages_per_slot):
        if len(pages) > max_pages_per_seq:
            raise ValueError(f"slot {slot} has {len(pages)} pages > {max_pages_per_seq=}")
        table[slot, : len(pages)] = pages
    return table


@struct.dataclass
class WriteIndices:
    """Where one token group's new tokens land; computed once per forward, shared by all layers."""

    slots: jax.Array  # i32[B]: the cache slot of each row
    block_tables: jax.Array  # i32[B, max_pages_per_seq]: the rows' block tables
    page_ids: jax.Array  # i32[B, T]; == num_pages (out of bounds, dropped) for padding
    offsets: jax.Array  # i32[B, T]: position within the page
    cache_index: jax.Array  # i32[B, T]: logical position of each new token in its sequence
    new_lengths: jax.Array  # i32[B]: the rows' cache lengths after this step


def write_indices(state: PagedKVState, slots: jax.Array, num_new: jax.Array, seq_len: int) -> WriteIndices:
    """Place `num_new[b]` tokens (of a padded row of `seq_len`) after slot `slots[b]`'s cache.

    Padding tokens (t >= num_new[b]), tokens beyond the block table and tokens whose
    block is NULL_PAGE get the page id `num_pages`, which `scatter(mode="drop")`
    discards: they can never overwrite a page, the reserved one included.
    """
    t = jnp.arange(seq_len, dtype=jnp.int32)
    lengths = state.lengths[slots]
    block_tables = state.block_tables[slots]
    cache_index = lengths[:, None] + t[None, :]  # [B, T]
    logical_page = cache_index // state.page_size
    in_table = logical_page < state.max_pages_per_seq
    page_ids = jnp.take_along_axis(block_tables, jnp.minimum(logical_page, state.max_pages_per_seq - 1), axis=1)
    valid = (t[None, :] < num_new[:, None]) & in_table & (page_ids != NULL_PAGE)
    return WriteIndices(
        slots=slots,
        block_tables=block_tables,
        page_ids=jnp.where(valid, page_ids, state.num_pages),
        offsets=cache_index % state.page_size,
        cache_index=cache_index,
        new_lengths=lengths + num_new,
    )


def scatter_tokens(pages: jax.Array, new: jax.Array, idx: WriteIndices) -> jax.Array:
    """Scatter new: [B, T, ...] into pages: [P, page_size, ...] (padding is dropped)."""
    return pages.at[idx.page_ids, idx.offsets].set(new.astype(pages.dtype), mode="drop")


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """pages: [P, page_size, ...], block_tables: i32[B, n] -> [B, n * page_size, ...]."""
    gathered = pages[block_tables]  # [B, n, page_size, ...]
    b, n, s = gathered.shape[:3]
    return gathered.reshape(b, n * s, *gathered.shape[3:])
