"""The MLA latent cache: per token one normalised latent `c_kv` and one shared RoPE key.

DeepSeek-V2/V3 multi-head latent attention caches `kv_lora_rank + qk_rope_dim` numbers
per token and layer instead of per-head keys and values (576 vs 40960 for DeepSeek-V3).
`LatentKV` plays the role `LayerKV` plays for MHA/GQA (the `LayerCache` protocol,
`jaxinfer.kv.layer_cache`): `write` scatters this step's tokens into the pages, `gather`
reads each sequence's pages in logical order.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import MLAConfig
from jaxinfer.kv.pages import KVCacheSpec, WriteIndices, gather_pages, scatter_tokens


@struct.dataclass
class LatentKV:
    c_kv: jax.Array  # [num_pages, page_size, kv_lora_rank]: kv_a_layernorm(latent), shared by all heads
    k_rope: jax.Array  # [num_pages, page_size, qk_rope_dim]: rotated RoPE key, shared by all heads
    layer: jax.Array | None = None  # i32[]: on a view into a run, leaves are [L, ...]: this layer's

    splits_over_mesh: ClassVar[bool] = False  # no KV heads to split: left to GSPMD

    @classmethod
    def zeros(cls, mla: MLAConfig, spec: KVCacheSpec, dtype) -> LatentKV:
        pages = (spec.num_pages, spec.page_size)
        return cls(c_kv=jnp.zeros((*pages, mla.kv_lora_rank), dtype), k_rope=jnp.zeros((*pages, mla.qk_rope_dim), dtype))

    def write(self, c_kv: jax.Array, k_rope: jax.Array, idx: WriteIndices) -> LatentKV:
        """Scatter this step's c_kv: [B, T, r] and k_rope: [B, T, dr] to the slots named by `idx`."""
        return self.replace(c_kv=scatter_tokens(self.c_kv, c_kv, idx, self.layer),
                            k_rope=scatter_tokens(self.k_rope, k_rope, idx, self.layer))

    def gather(self, block_tables: jax.Array, lengths: jax.Array | None = None,
               slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Each sequence's pages in logical order: [B, S, r] and [B, S, dr] (`lengths` and
        `slots` are unused; they keep the protocol's signature)."""
        return gather_pages(self.c_kv, block_tables, self.layer), gather_pages(self.k_rope, block_tables, self.layer)

    def bytes_per_token(self) -> float:
        """The latent and the RoPE key of one token (shared by every head)."""
        return (self.c_kv.shape[-1] + self.k_rope.shape[-1]) * jnp.dtype(self.c_kv.dtype).itemsize
