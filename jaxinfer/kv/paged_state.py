"""The paged KV cache of a whole model as an immutable, fixed-shape pytree.

`PagedKVState` holds one layer cache per model layer (any format of
`jaxinfer.kv.layer_cache`), or one per run of alike layers stacked along a leading layer axis
(`jaxinfer.layer_stack`), the block tables and the lengths; page addressing is in
`jaxinfer.kv.pages` (diagram there). `write_indices` places a step's tokens: after each
slot's cached tokens, or into a StreamingLLM ring (`jaxinfer.kv.streaming`). With
`window_tables`, the sliding-window layers of a hybrid model keep a bounded pool of their own
(a ring of pages per slot, `jaxinfer.kv.window_ring`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer import layer_stack
from jaxinfer.config import ModelConfig
from jaxinfer.kv.dense import LayerKV
from jaxinfer.kv.formats import get_format
from jaxinfer.kv.latent import LatentKV
from jaxinfer.kv.layer_cache import LayerCache, make_layer_kv, stored_kv_heads
from jaxinfer.kv.pages import (NULL_PAGE, KVCacheSpec, WriteIndices, block_table_array, gather_pages,
                               scatter_tokens)
from jaxinfer.kv.plan import KVCacheArg, resolve_kv_cache
from jaxinfer.kv.streaming import StreamingSpec, ring_write_indices
from jaxinfer.kv.window_ring import ring_pool_pages, ring_tables

# Names that lived here before `pages`, `dense` and `layer_cache` split out; kept for one release.
__all__ = ["NULL_PAGE", "KVCacheSpec", "LayerKV", "PagedKVState", "WriteIndices", "block_table_array",
           "gather_pages", "init_paged_kv", "scatter_tokens", "stored_kv_heads", "write_indices"]


@struct.dataclass
class PagedKVState:
    layers: tuple[LayerCache, ...] | tuple[layer_stack.LayerStack, ...]  # per layer, or per run of layers
    block_tables: jax.Array  # i32[max_slots, max_pages_per_seq]
    lengths: jax.Array  # i32[max_slots]: tokens already cached per slot
    # Static: None = logical block tables; a StreamingSpec = each slot is a bounded
    # StreamingLLM ring of sinks + recent tokens (`jaxinfer.kv.streaming`).
    streaming: StreamingSpec | None = struct.field(pytree_node=False, default=None)
    # i32[max_slots, R]: each slot's ring of pages in the windowed layers' own pool (of
    # `window_pool_pages`), or None: every layer uses `block_tables` (`jaxinfer.kv.window_ring`).
    window_tables: jax.Array | None = None
    # Static: pages of the windowed layers' pool (`jaxinfer.kv.window_ring.ring_pool_pages`), or None.
    window_pool_pages: int | None = struct.field(pytree_node=False, default=None)

    @property
    def num_pages(self) -> int:
        """Pages in the pool of the layers addressed by `block_tables` (not the windowed pool)."""
        pools = [shape[0] for shape in self._leaf_shapes]
        return next((n for n in pools if n != self.window_pool_pages), pools[0])

    @property
    def page_size(self) -> int:
        return self._leaf_shapes[0][1]

    @property
    def _leaf_shapes(self) -> list[tuple[int, ...]]:
        """[pool pages, page_size, ...] of each entry's first leaf (a run's has a leading layer axis)."""
        return [jax.tree.leaves(e)[0].shape[isinstance(e, layer_stack.LayerStack):] for e in self.layers]

    @property
    def max_slots(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]


def init_paged_kv(config: ModelConfig, spec: KVCacheSpec, dtype=None,
                  streaming: StreamingSpec | None = None, kv_cache: KVCacheArg = "auto",
                  kv_head_copies: int = 1, layer_runs: tuple[int, ...] | None = None,
                  window_ring: int | None = None, window_replicas: int = 1) -> PagedKVState:
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

    `layer_runs` (lengths summing to `n_layers`): the stacked layout, one cache per run with a
    leading layer axis (`jaxinfer.layer_stack`; the runs must hold alike layers), allocated
    stacked rather than stacked after the fact, which would briefly hold the pool twice.

    `window_ring=R`: the sliding-window layers get a pool of their own, `spec.max_slots * R + 1`
    pages, each slot a ring of R (`jaxinfer.kv.window_ring.ring_pages` sizes it); the global
    layers keep `spec.num_pages`. Needs a model with both kinds of layer and no streaming.
    `window_replicas=D` (a mesh's data axis) lays that pool out in D blocks, one per replica's
    slots, `D * (spec.max_slots / D * R + 1)` pages (`jaxinfer.kv.window_ring.ring_pool_pages`).
    """
    if not isinstance(kv_head_copies, int) or kv_head_copies < 1:
        raise ValueError(f"kv_head_copies={kv_head_copies!r} must be a positive integer")
    if kv_head_copies > 1 and config.mla is not None:
        raise ValueError("MLA latent pages have no KV heads to copy (kv_head_copies must be 1)")
    if config.q_per_kv % kv_head_copies:
        raise ValueError(f"kv_head_copies={kv_head_copies} must divide the query heads per KV head "
                         f"({config.n_heads} / {config.n_kv_heads} = {config.q_per_kv}), or queries would read the wrong copy")
    if window_ring is not None:
        _check_window_ring(config, window_ring, streaming)
    if layer_runs is not None:
        def stacked() -> PagedKVState:  # under jit: the unrolled zeros are never materialized
            kv = init_paged_kv(config, spec, dtype, streaming, kv_cache, kv_head_copies, window_ring=window_ring,
                               window_replicas=window_replicas)
            return kv.replace(layers=layer_stack.stack(kv.layers, layer_runs))
        return jax.jit(stacked)()
    dtype = jnp.dtype(dtype or config.dtype)
    if kv_cache != "auto" and (config.mla is not None or streaming is not None):
        _check_kv_cache_with(kv_cache, config, streaming)
    ring_spec = None if window_ring is None else dataclasses.replace(
        spec, num_pages=ring_pool_pages(spec.max_slots, window_ring, window_replicas), max_pages_per_seq=window_ring)

    def layer_spec(i: int) -> KVCacheSpec:  # the pool layer i's pages live in
        return ring_spec if ring_spec is not None and config.window(i) is not None else spec

    if config.mla is not None:
        if streaming is not None:
            raise ValueError("a streaming cache is not supported for MLA models")
        layers = tuple(LatentKV.zeros(config.mla, spec, dtype) for _ in range(config.n_layers))
    elif kv_cache == "auto":
        heads = (config.n_kv_heads * kv_head_copies, config.head_dim)
        layers = tuple(LayerKV(k=jnp.zeros((s.num_pages, s.page_size, *heads), dtype),
                               v=jnp.zeros((s.num_pages, s.page_size, *heads), dtype))
                       for s in map(layer_spec, range(config.n_layers)))
    else:
        formats = resolve_kv_cache(kv_cache, config.n_layers, dtype.name, spec.page_size)
        layers = tuple(make_layer_kv(f, layer_spec(i), config.n_kv_heads, config.head_dim, dtype, kv_head_copies)
                       for i, f in enumerate(formats))
    return PagedKVState(
        layers=layers,
        block_tables=jnp.full((spec.max_slots, spec.max_pages_per_seq), NULL_PAGE, jnp.int32),
        lengths=jnp.zeros((spec.max_slots,), jnp.int32),
        streaming=streaming,
        window_tables=None if window_ring is None else jnp.asarray(ring_tables(spec.max_slots, window_ring, window_replicas)),
        window_pool_pages=None if ring_spec is None else ring_spec.num_pages,
    )


def _check_window_ring(config: ModelConfig, ring: int, streaming: StreamingSpec | None) -> None:
    kinds = {config.window(i) is None for i in range(config.n_layers)}
    if kinds != {True, False} or streaming is not None:
        raise ValueError(f"window_ring={ring} needs a model with both windowed and global layers "
                         f"(layer_windows={config.layer_windows}) and no streaming cache")
    if not isinstance(ring, int) or ring < 2:
        raise ValueError(f"window_ring={ring!r} must be an integer >= 2")


def _check_kv_cache_with(kv_cache: KVCacheArg, config: ModelConfig, streaming: StreamingSpec | None) -> None:
    """Quantized formats need per-head K/V in logical pages: not MLA, and no KIVI in a ring."""
    if config.mla is not None:
        raise ValueError(f"kv_cache={kv_cache!r}: MLA models support only kv_cache='auto'")
    kivi = [f for f in resolve_kv_cache(kv_cache, config.n_layers, "float32") if get_format(f).has_tail]
    if kivi:
        raise ValueError(f"kv_cache={kv_cache!r}: the {kivi[0]!r} format cannot be used with a streaming cache")


def write_indices(state: PagedKVState, slots: jax.Array, num_new: jax.Array, seq_len: int) -> WriteIndices:
    """Place `num_new[b]` tokens (of a padded row of `seq_len`) after slot `slots[b]`'s cache
    (in a streaming cache: at their ring positions, `jaxinfer.kv.streaming.ring_write_indices`).

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
    idx = WriteIndices(
        slots=slots,
        block_tables=block_tables,
        page_ids=jnp.where(valid, page_ids, state.num_pages),
        offsets=cache_index % state.page_size,
        cache_index=cache_index,
        new_lengths=lengths + num_new,
    )
    if state.streaming is None:
        return idx
    return ring_write_indices(idx, state.streaming, num_new, state.page_size, state.num_pages)
