"""Quantized per-layer cache pytrees: the same `write` / `gather` contract as `LayerKV`.

`write` quantizes what it stores; `gather` dequantizes only the pages named by the block
tables, never the whole pool. The math and the storage layout are in
`jaxinfer.kv.formats`; this module only places codes and scales into pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.kv import formats as F
from jaxinfer.kv.paged_state import NULL_PAGE, KVCacheSpec, LayerKV, WriteIndices, gather_pages, scatter_tokens


@struct.dataclass
class TokenQuantLayerKV:
    """int8 / fp8: every token of every KV head quantized on write with its own absmax scale."""

    k_q: jax.Array  # i8 | f8[num_pages, page_size, n_kv_heads, head_dim]
    v_q: jax.Array  # same
    k_scale: jax.Array  # bf16[num_pages, page_size, n_kv_heads]
    v_scale: jax.Array  # bf16[num_pages, page_size, n_kv_heads]
    format: str = struct.field(pytree_node=False)  # "int8" | "fp8_e4m3" | "fp8_e5m2"
    dtype: str = struct.field(pytree_node=False)  # dtype `gather` returns

    @property
    def num_pages(self) -> int:
        return self.k_q.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_q.shape[1]

    def _quantize(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.format == "int8":
            return F.quantize_int8(x)
        return F.quantize_fp8(x, F.fp8_dtype(self.format))

    def write(self, k: jax.Array, v: jax.Array, idx: WriteIndices) -> TokenQuantLayerKV:
        """Quantize this step's k, v: [B, T, Hkv, Dh] and scatter codes and scales to `idx`."""
        kq, ks = self._quantize(k)
        vq, vs = self._quantize(v)
        return self.replace(
            k_q=scatter_tokens(self.k_q, kq, idx), v_q=scatter_tokens(self.v_q, vq, idx),
            k_scale=scatter_tokens(self.k_scale, ks, idx), v_scale=scatter_tokens(self.v_scale, vs, idx),
        )

    def gather(self, block_tables: jax.Array, lengths: jax.Array | None = None,
               slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Dequantized pages of each sequence in logical order: two [B, n * page_size, Hkv, Dh]."""
        def pages(q, s):
            return F.dequantize_int8(q, s, self.dtype) if self.format == "int8" else F.dequantize_fp8(q, s, self.dtype)

        return (pages(gather_pages(self.k_q, block_tables), gather_pages(self.k_scale, block_tables)),
                pages(gather_pages(self.v_q, block_tables), gather_pages(self.v_scale, block_tables)))


@struct.dataclass
class KiviLayerKV:
    """int4 / int2 in the KIVI layout: keys per channel over a page, values per token.

    A page is quantized once it is full. The tokens of the page being filled live in the
    slot's full-precision tail row, at their offset in the page::

        page_size = 4, a slot with 6 tokens:   pages  [q q q q] [. . . .]   (second page unwritten)
                                               tail   [t4 t5 . .]           logical page 6 // 4 = 1

    Writing t6, t7 fills the second page: it is quantized from tail + new tokens, written to
    its physical page, and the tail starts over. An engine that forks a sequence must copy
    its tail row along with its pages.
    """

    k_q: jax.Array  # u8[num_pages, page_size, n_kv_heads, head_dim * bits / 8]
    v_q: jax.Array  # same
    k_scale: jax.Array  # bf16[num_pages, n_kv_heads, head_dim]: per page, per channel
    k_zero: jax.Array  # bf16[num_pages, n_kv_heads, head_dim]
    v_scale: jax.Array  # bf16[num_pages, page_size, n_kv_heads]: per token
    v_zero: jax.Array  # bf16[num_pages, page_size, n_kv_heads]
    k_tail: jax.Array  # compute[max_slots, page_size, n_kv_heads, head_dim]: the page being filled
    v_tail: jax.Array  # compute[max_slots, page_size, n_kv_heads, head_dim]
    format: str = struct.field(pytree_node=False)  # "int4" | "int2"

    @property
    def num_pages(self) -> int:
        return self.k_q.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_q.shape[1]

    @property
    def bits(self) -> int:
        return F.get_format(self.format).bits

    def write(self, k: jax.Array, v: jax.Array, idx: WriteIndices) -> KiviLayerKV:
        """Append k, v: [B, T, Hkv, Dh]; quantize every page this completes; keep the rest in the tail.

        Row b's new tokens follow the `off = length % page_size` tokens already in its tail.
        Tail + new tokens are laid out from the start of the current page in a window of
        `n = ceil((page_size - 1 + T) / page_size)` pages; window page c is full iff
        `(c + 1) * page_size <= off + num_new`, and only full pages reach the pool.
        """
        ps, (b, t) = self.page_size, k.shape[:2]
        start = idx.cache_index[:, 0]  # i32[B]: the rows' lengths before this write
        num_new = idx.new_lengths - start
        off = start % ps
        n = -(-(ps - 1 + t) // ps)
        kw = self._window(self.k_tail, k, idx.slots, off).reshape(b, n, ps, *k.shape[2:])
        vw = self._window(self.v_tail, v, idx.slots, off).reshape(b, n, ps, *v.shape[2:])

        c = jnp.arange(n, dtype=jnp.int32)
        logical = start[:, None] // ps + c[None, :]  # [B, n]
        max_pages = idx.block_tables.shape[1]
        page = jnp.take_along_axis(idx.block_tables, jnp.minimum(logical, max_pages - 1), axis=1)
        full = ((c[None, :] + 1) * ps <= (off + num_new)[:, None]) & (logical < max_pages) & (page != NULL_PAGE)
        page = jnp.where(full, page, self.num_pages)  # out of bounds: dropped by the scatter

        kq, ks, kz = F.quantize_kivi_keys(kw, self.bits)
        vq, vs, vz = F.quantize_kivi_values(vw, self.bits)
        last = jnp.minimum((off + num_new) // ps, n - 1)  # window page holding the new tail
        tail_slot = jnp.where(num_new > 0, idx.slots, self.k_tail.shape[0])  # idle rows keep theirs
        rows = jnp.arange(b)

        def put(pages, new):
            return pages.at[page].set(new, mode="drop")

        return self.replace(
            k_q=put(self.k_q, kq), v_q=put(self.v_q, vq),
            k_scale=put(self.k_scale, ks), k_zero=put(self.k_zero, kz),
            v_scale=put(self.v_scale, vs), v_zero=put(self.v_zero, vz),
            k_tail=self.k_tail.at[tail_slot].set(kw[rows, last], mode="drop"),
            v_tail=self.v_tail.at[tail_slot].set(vw[rows, last], mode="drop"),
        )

    @staticmethod
    def _window(tail: jax.Array, new: jax.Array, slots: jax.Array, off: jax.Array) -> jax.Array:
        """[B, n * page_size, Hkv, Dh]: positions j < off from the slot's tail, j >= off from new[j - off]."""
        ps, t = tail.shape[1], new.shape[1]
        n = -(-(ps - 1 + t) // ps)
        j = jnp.arange(n * ps, dtype=jnp.int32)
        from_tail = jnp.take(tail[slots], jnp.minimum(j, ps - 1), axis=1)
        from_new = jnp.take_along_axis(new.astype(tail.dtype), jnp.clip(j[None, :] - off[:, None], 0, t - 1)[:, :, None, None], axis=1)
        return jnp.where((j[None, :] < off[:, None])[:, :, None, None], from_tail, from_new)

    def gather(self, block_tables: jax.Array, lengths: jax.Array | None = None,
               slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Dequantized pages in logical order, the current page read from the tail: two [B, n * page_size, Hkv, Dh].

        `lengths` (i32[B], this step's tokens included) and `slots` (i32[B]) are required.
        """
        if lengths is None or slots is None:
            raise ValueError(f"the {self.format!r} KV cache needs lengths and slots to gather (its current page is in a per-slot tail)")
        bits, dtype = self.bits, self.k_tail.dtype
        g = lambda a: a[block_tables]  # [B, n, ...]
        k = F.dequantize_kivi_keys(g(self.k_q), g(self.k_scale), g(self.k_zero), bits, dtype)
        v = F.dequantize_kivi_values(g(self.v_q), g(self.v_scale), g(self.v_zero), bits, dtype)
        b, n, ps = k.shape[:3]
        in_tail = (jnp.arange(n) == (lengths // ps)[:, None])[:, :, None, None, None]  # [B, n, 1, 1, 1]
        k = jnp.where(in_tail, self.k_tail[slots][:, None], k)
        v = jnp.where(in_tail, self.v_tail[slots][:, None], v)
        return k.reshape(b, n * ps, *k.shape[3:]), v.reshape(b, n * ps, *v.shape[3:])


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
