"""int4 / int2 pages in the KIVI layout: keys quantized per channel over a page, values per token.

A page is quantized once it is full; until then its tokens live in full precision in the
slot's tail row. The math and the storage layout are in `jaxinfer.kv.formats`.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.kv import formats as F
from jaxinfer.kv.pages import NULL_PAGE, WriteIndices, at_layer


@struct.dataclass
class KiviLayerKV:
    """One layer's int4 / int2 pages in the KIVI layout: keys per channel over a page, values
    per token (the `LayerCache` protocol, `jaxinfer.kv.layer_cache`).

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
    layer: jax.Array | None = None  # i32[]: on a view into a run, leaves are [L, ...]: this layer's

    # Per-slot tails are not [num_pages, ...]: left to GSPMD rather than split per device.
    splits_over_mesh: ClassVar[bool] = False

    @property
    def num_pages(self) -> int:
        return self.k_q.shape[-4]

    @property
    def page_size(self) -> int:
        return self.k_q.shape[-3]

    @property
    def max_slots(self) -> int:
        return self.k_tail.shape[-4]

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
        kw = self._window(self.k_tail[at_layer(self.layer, idx.slots)], k, off).reshape(b, n, ps, *k.shape[2:])
        vw = self._window(self.v_tail[at_layer(self.layer, idx.slots)], v, off).reshape(b, n, ps, *v.shape[2:])

        c = jnp.arange(n, dtype=jnp.int32)
        logical = start[:, None] // ps + c[None, :]  # [B, n]
        max_pages = idx.block_tables.shape[1]
        page = jnp.take_along_axis(idx.block_tables, jnp.minimum(logical, max_pages - 1), axis=1)
        full = ((c[None, :] + 1) * ps <= (off + num_new)[:, None]) & (logical < max_pages) & (page != NULL_PAGE)
        page = jnp.where(full, page, self.num_pages)  # out of bounds: dropped by the scatter

        kq, ks, kz = F.quantize_kivi_keys(kw, self.bits)
        vq, vs, vz = F.quantize_kivi_values(vw, self.bits)
        last = jnp.minimum((off + num_new) // ps, n - 1)  # window page holding the new tail
        tail_slot = jnp.where(num_new > 0, idx.slots, self.max_slots)  # idle rows keep theirs
        rows = jnp.arange(b)

        def put(pages, new):
            return pages.at[at_layer(self.layer, page)].set(new, mode="drop")

        return self.replace(
            k_q=put(self.k_q, kq), v_q=put(self.v_q, vq),
            k_scale=put(self.k_scale, ks), k_zero=put(self.k_zero, kz),
            v_scale=put(self.v_scale, vs), v_zero=put(self.v_zero, vz),
            k_tail=self.k_tail.at[at_layer(self.layer, tail_slot)].set(kw[rows, last], mode="drop"),
            v_tail=self.v_tail.at[at_layer(self.layer, tail_slot)].set(vw[rows, last], mode="drop"),
        )

    @staticmethod
    def _window(tails: jax.Array, new: jax.Array, off: jax.Array) -> jax.Array:
        """tails: the rows' tails [B, page_size, Hkv, Dh] -> [B, n * page_size, Hkv, Dh]:
        positions j < off from the row's tail, j >= off from new[j - off]."""
        ps, t = tails.shape[1], new.shape[1]
        n = -(-(ps - 1 + t) // ps)
        j = jnp.arange(n * ps, dtype=jnp.int32)
        from_tail = jnp.take(tails, jnp.minimum(j, ps - 1), axis=1)
        from_new = jnp.take_along_axis(new.astype(tails.dtype), jnp.clip(j[None, :] - off[:, None], 0, t - 1)[:, :, None, None], axis=1)
        return jnp.where((j[None, :] < off[:, None])[:, :, None, None], from_tail, from_new)

    def gather(self, block_tables: jax.Array, lengths: jax.Array | None = None,
               slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Dequantized pages in logical order, the current page read from the tail: two [B, n * page_size, Hkv, Dh].

        `lengths` (i32[B], this step's tokens included) and `slots` (i32[B]) are required.
        """
        if lengths is None or slots is None:
            raise ValueError(f"the {self.format!r} KV cache needs lengths and slots to gather (its current page is in a per-slot tail)")
        bits, dtype = self.bits, self.k_tail.dtype
        g = lambda a: a[at_layer(self.layer, block_tables)]  # [B, n, ...]
        k = F.dequantize_kivi_keys(g(self.k_q), g(self.k_scale), g(self.k_zero), bits, dtype)
        v = F.dequantize_kivi_values(g(self.v_q), g(self.v_scale), g(self.v_zero), bits, dtype)
        b, n, ps = k.shape[:3]
        in_tail = (jnp.arange(n) == (lengths // ps)[:, None])[:, :, None, None, None]  # [B, n, 1, 1, 1]
        k = jnp.where(in_tail, self.k_tail[at_layer(self.layer, slots)][:, None], k)
        v = jnp.where(in_tail, self.v_tail[at_layer(self.layer, slots)][:, None], v)
        return k.reshape(b, n * ps, *k.shape[3:]), v.reshape(b, n * ps, *v.shape[3:])

    def bytes_per_token(self) -> float:
        """Codes, scales and zero-points of one token in the pool, K and V, all heads (the
        per-slot tail is extra: `KVFormat.slot_overhead_bytes`)."""
        return F.get_format(self.format).bytes_per_token(self.k_tail.shape[-2], self.k_tail.shape[-1], self.page_size)
