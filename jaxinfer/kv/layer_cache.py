"""What every per-layer cache format offers the forward, and how one is made.

A layer's cache is an immutable pytree with three methods, so the forward, the attention
references and the kernels never ask which format they hold::

    format            module           write(k, v, idx)            gather(tables, lengths, slots)
    f32 / bf16        kv.dense         scatter tokens              pages in logical order
    int8 / fp8_*      kv.token_quant   quantize each token         dequantize the named pages
    int4 / int2       kv.kivi          quantize pages as they fill pages + the slot's tail page
    MLA latent        kv.latent        scatter c_kv and k_rope     (c_kv, k_rope) pages

`bytes_per_token()` is what one cached token costs in the pool, and `splits_over_mesh` says
whether every leaf is `[num_pages, page_size, heads, ...]`, so the paged writes and attention
can run per device on a mesh (`jaxinfer.attention.mesh`); others are left to GSPMD.

Stacked runs (`jaxinfer.layer_stack`): a run of alike layers is one cache of the format whose
every leaf has a leading `[n]` layer axis. The forward's `lax.scan` over the run sees a *view*
of it: the stacked leaves with `layer` (i32[]) set, and `write` / `gather` index that layer
of the stacked arrays, so a write scatters into the run's pool in place (slicing the layer out
and putting it back would copy a layer's pages per layer and step).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jaxinfer.kv import formats as F
from jaxinfer.kv.dense import LayerKV
from jaxinfer.kv.kivi import KiviLayerKV
from jaxinfer.kv.pages import KVCacheSpec, WriteIndices
from jaxinfer.kv.token_quant import TokenQuantLayerKV


@runtime_checkable
class LayerCache(Protocol):
    """One layer's paged cache in some storage format (see the module docstring)."""

    splits_over_mesh: ClassVar[bool]
    layer: jax.Array | None  # i32[]: set on a view into a stacked run (leaves [n, ...]), else None

    def write(self, k: jax.Array, v: jax.Array, idx: WriteIndices) -> LayerCache:
        """This step's tokens [B, T, ...] stored at `idx`; returns the new layer cache."""
        ...

    def gather(self, block_tables: jax.Array, lengths: jax.Array | None = None,
               slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Each row's pages in logical order, dequantized: two [B, n * page_size, ...]."""
        ...

    def bytes_per_token(self) -> float:
        """Bytes one cached token takes in the pool (K and V, scales included)."""
        ...


def stored_kv_heads(layer_kv: LayerCache) -> int:
    """KV heads a layer's pages hold (`n_kv_heads` times `kv_head_copies`): every per-head
    format's first leaf is `[(L,) num_pages, page_size, heads, x]`."""
    return jax.tree.leaves(layer_kv)[0].shape[-2]


def own_layer(layer_kv: LayerCache) -> LayerCache:
    """A view's layer as a cache of its own (a copy of its pages), for code that reads the
    leaves themselves (the Pallas kernels); any other cache as it is."""
    if layer_kv.layer is None:
        return layer_kv
    return jax.tree.map(lambda a: a[layer_kv.layer], layer_kv.replace(layer=None))


def make_layer_kv(name: str, spec: KVCacheSpec, n_kv_heads: int, head_dim: int, dtype,
                  kv_head_copies: int = 1) -> LayerKV | TokenQuantLayerKV | KiviLayerKV:
    """An empty layer cache of format `name`; `dtype` is what `gather` returns (and the tail's dtype).

    `kv_head_copies`: see `init_paged_kv`. KIVI layers keep one copy: they are not split over
    `model` (their per-slot tails stay with GSPMD), so copies would only cost memory."""
    f = F.get_format(name)
    if not f.has_tail:
        n_kv_heads *= kv_head_copies
    dtype = jnp.dtype(dtype)
    pages = (spec.num_pages, spec.page_size, n_kv_heads)
    z = jnp.zeros  # a fresh buffer per field: donation rejects a buffer that appears twice
    if f.kind == "dense":
        return LayerKV(k=z((*pages, head_dim), f.storage_dtype), v=z((*pages, head_dim), f.storage_dtype))
    if f.kind in ("int8", "fp8"):
        return TokenQuantLayerKV(k_q=z((*pages, head_dim), f.storage_dtype), v_q=z((*pages, head_dim), f.storage_dtype),
                                 k_scale=z(pages, F.SCALE_DTYPE), v_scale=z(pages, F.SCALE_DTYPE),
                                 format=name, dtype=dtype.name)
    if head_dim % (8 // f.bits):
        raise ValueError(f"{head_dim=} must be a multiple of {8 // f.bits} for the {name!r} KV cache")
    packed = (*pages, head_dim * f.bits // 8)
    per_channel = (spec.num_pages, n_kv_heads, head_dim)
    tail = (spec.max_slots, spec.page_size, n_kv_heads, head_dim)
    return KiviLayerKV(k_q=z(packed, jnp.uint8), v_q=z(packed, jnp.uint8),
                       k_scale=z(per_channel, F.SCALE_DTYPE), k_zero=z(per_channel, F.SCALE_DTYPE),
                       v_scale=z(pages, F.SCALE_DTYPE), v_zero=z(pages, F.SCALE_DTYPE),
                       k_tail=z(tail, dtype), v_tail=z(tail, dtype), format=name)


def one_shot_round_trip(name: str, k: jax.Array, v: jax.Array, page_size: int, dtype=None) -> tuple[jax.Array, jax.Array]:
    """What a `name` cache returns for sequences written in one step from position 0.

    k, v: [B, T, Hkv, Dh] -> the gathered (dequantized) [B, T, Hkv, Dh], through the real
    `write` and `gather`: for KIVI formats every full page is quantized and a trailing
    partial page stays exact. Calibration and tests use it to see a format's error.
    """
    b, t, h, d = k.shape
    dtype = jnp.dtype(dtype or k.dtype)
    n = -(-t // page_size)
    spec = KVCacheSpec(num_pages=b * n + 1, page_size=page_size, max_slots=b, max_pages_per_seq=n)
    layer = make_layer_kv(name, spec, h, d, dtype)
    block_tables = 1 + jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
    cache_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    idx = WriteIndices(
        slots=jnp.arange(b, dtype=jnp.int32), block_tables=block_tables,
        page_ids=jnp.take_along_axis(block_tables, cache_index // page_size, axis=1), offsets=cache_index % page_size,
        cache_index=cache_index, new_lengths=jnp.full((b,), t, jnp.int32),
    )
    kq, vq = layer.write(k.astype(dtype), v.astype(dtype), idx).gather(block_tables, idx.new_lengths, idx.slots)
    return kq[:, :t].astype(dtype), vq[:, :t].astype(dtype)
