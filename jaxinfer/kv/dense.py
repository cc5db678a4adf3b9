"""Full-precision K/V pages (f32 / bf16): the plain format every other one is measured against."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.kv.pages import WriteIndices, gather_pages, scatter_tokens


@struct.dataclass
class LayerKV:
    """One layer's full-precision K/V pages (the `LayerCache` protocol, `jaxinfer.kv.layer_cache`)."""

    k: jax.Array  # [num_pages, page_size, n_kv_heads, head_dim]
    v: jax.Array  # [num_pages, page_size, n_kv_heads, head_dim]
    layer: jax.Array | None = None  # i32[]: on a view into a run, k and v are [L, ...]: this layer's

    splits_over_mesh: ClassVar[bool] = True

    def write(self, k: jax.Array, v: jax.Array, idx: WriteIndices) -> LayerKV:
        """Scatter this step's k, v: [B, T, Hkv, Dh] to the slots named by `idx`."""
        return self.replace(k=scatter_tokens(self.k, k, idx, self.layer), v=scatter_tokens(self.v, v, idx, self.layer))

    def gather(self, block_tables: jax.Array, lengths: jax.Array | None = None,
               slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Each sequence's pages in logical order: two [B, max_pages * page_size, Hkv, Dh].

        `lengths` (i32[B]) and `slots` (i32[B]) are unused here; formats that keep the page
        being filled outside the pool (`jaxinfer.kv.kivi.KiviLayerKV`) need them.
        """
        return gather_pages(self.k, block_tables, self.layer), gather_pages(self.v, block_tables, self.layer)

    def bytes_per_token(self) -> float:
        """K and V of one token, all heads."""
        return 2 * self.k.shape[-2] * self.k.shape[-1] * jnp.dtype(self.k.dtype).itemsize
