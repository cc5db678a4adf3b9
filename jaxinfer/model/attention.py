"""Attention over the paged KV cache: the pure-`jnp` reference.

This is the readable, obviously correct version the Pallas kernels are checked against.
It gathers each sequence's pages through its block table into a dense
[B, max_pages_per_seq * page_size] key axis and masks what the sequence may not see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.kv.paged_state import LayerKV

# Finite, so a row with no visible key gives a uniform softmax over zeroed values
# (output 0) instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def paged_attention_reference(
    q: jax.Array,  # [B, T, Hq, Dh]: queries, already rotated
    layer_kv: LayerKV,  # one layer's pages, this step's keys and values already written
    block_tables: jax.Array,  # i32[B, max_pages]
    kv_lengths: jax.Array,  # i32[B]: cached tokens per sequence, this step's included
    query_index: jax.Array,  # i32[B, T]: cache position of each query (causal limit)
    scale: float,
) -> jax.Array:
    """Causal GQA attention through block tables -> [B, T, Hq, Dh] (dtype of q).

    Key j of sequence b is visible to query t iff `j < kv_lengths[b]` and
    `j <= query_index[b, t]`. Invisible keys and values are replaced before use, so
    whatever an unowned page holds (stale data, another request's KV, NaN) cannot leak.
    """
    b, t, hq, dh = q.shape
    k, v = layer_kv.gather(block_tables)  # [B, S, Hkv, Dh] each
    hkv = k.shape[2]
    key_index = jnp.arange(k.shape[1], dtype=jnp.int32)
    in_sequence = key_index[None, :] < kv_lengths[:, None]  # [B, S]
    v = jnp.where(in_sequence[:, :, None, None], v, 0)
    visible = in_sequence[:, None, :] & (key_index[None, None, :] <= query_index[:, :, None])

    qg = q.reshape(b, t, hkv, hq // hkv, dh)  # query heads grouped by the KV head they read
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, dh).astype(q.dtype)
