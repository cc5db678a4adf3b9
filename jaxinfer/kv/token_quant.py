"""int8 / fp8 pages: every token of every KV head quantized on write with its own absmax scale.

The math and the storage layout are in `jaxinfer.kv.formats`; this module only places
codes and scales into pages and dequantizes the pages a gather names.
"""

from __future__ import annotations

from typing import ClassVar

import jax
from flax import struct

from jaxinfer.kv import formats as F
from jaxinfer.kv.pages import WriteIndices, gather_pages, scatter_tokens


@struct.dataclass
class TokenQuantLayerKV:
    """One layer's int8 / fp8 pages (the `LayerCache` protocol, `jaxinfer.kv.layer_cache`)."""

    k_q: jax.Array  # i8 | f8[num_pages, page_size, n_kv_heads, head_dim]
    v_q: jax.Array  # same
    k_scale: jax.Array  # bf16[num_pages, page_size, n_kv_heads]
    v_scale: jax.Array  # bf16[num_pages, page_size, n_kv_heads]
    format: str = struct.field(pytree_node=False)  # "int8" | "fp8_e4m3" | "fp8_e5m2"
    dtype: str = struct.field(pytree_node=False)  # dtype `gather` returns
    layer: jax.Array | None = None  # i32[]: on a view into a run, leaves are [L, ...]: this layer's

    splits_over_mesh: ClassVar[bool] = True

    def _quantize(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.format == "int8":
            return F.quantize_int8(x)
        return F.quantize_fp8(x, F.fp8_dtype(self.format))

    def _dequantize(self, q: jax.Array, scale: jax.Array) -> jax.Array:
        if self.format == "int8":
            return F.dequantize_int8(q, scale, self.dtype)
        return F.dequantize_fp8(q, scale, self.dtype)

    def write(self, k: jax.Array, v: jax.Array, idx: WriteIndices) -> TokenQuantLayerKV:
        """Quantize this step's k, v: [B, T, Hkv, Dh] and scatter codes and scales to `idx`."""
        kq, ks = self._quantize(k)
        vq, vs = self._quantize(v)
        put = lambda pages, new: scatter_tokens(pages, new, idx, self.layer)  # noqa: E731
        return self.replace(k_q=put(self.k_q, kq), v_q=put(self.v_q, vq), k_scale=put(self.k_scale, ks), v_scale=put(self.v_scale, vs))

    def gather(self, block_tables: jax.Array, lengths: jax.Array | None = None,
               slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Dequantized pages of each sequence in logical order: two [B, n * page_size, Hkv, Dh]."""
        g = lambda pages: gather_pages(pages, block_tables, self.layer)  # noqa: E731
        return self._dequantize(g(self.k_q), g(self.k_scale)), self._dequantize(g(self.v_q), g(self.v_scale))

    def bytes_per_token(self) -> float:
        """Codes and scales of one token, K and V, all heads."""
        page_size, heads, head_dim = self.k_q.shape[-3:]
        return F.get_format(self.format).bytes_per_token(heads, head_dim, page_size)
