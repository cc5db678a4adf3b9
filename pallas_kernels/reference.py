"""The slow, obviously correct reference every kernel in this package is checked against.

One sequence at a time: dequantize that sequence's pages (fine here, never in a kernel; a
KIVI sequence's current page comes from its slot's full-precision tail), score every
(query, key) pair, mask with `common.visible`, softmax with the optional sink logit as one
extra column, weight the values. It agrees with `jaxinfer.model.attention.
paged_attention_reference` (tests/test_pallas_reference.py) and with hand-computed values.
A query that sees no key (and has no sink) gets zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.kv import formats as F
from pallas_kernels.common import AttentionOptions, cap_scores, visible
from pallas_kernels.formats import KernelPages


@functools.partial(jax.jit, static_argnames=("scale", "opts"))
def paged_attention_per_sequence(
    q: jax.Array,  # [B, T, Hq, Dh]
    pages: KernelPages,
    block_tables: jax.Array,  # i32[B, max_pages]
    lengths: jax.Array,  # i32[B]: tokens cached per sequence (this step's included)
    query_pos: jax.Array,  # i32[B, T]: cache position of each query
    scale: float,
    opts: AttentionOptions = AttentionOptions(),
    sink_logits: jax.Array | None = None,  # f32[Hq]
    slots: jax.Array | None = None,  # i32[B]: cache slot of each row (KIVI tails)
) -> jax.Array:
    """-> [B, T, Hq, Dh] in q's dtype."""
    group = q.shape[2] // pages.num_kv_heads
    outs = []
    for b in range(q.shape[0]):
        k, v = sequence_kv(pages, block_tables[b], lengths[b], None if slots is None else slots[b])
        outs.append(_one_sequence(q[b], k, v, lengths[b], query_pos[b], scale, opts, sink_logits, group))
    return jnp.stack(outs).astype(q.dtype)


def sequence_kv(pages: KernelPages, table: jax.Array, length, slot) -> tuple[jax.Array, jax.Array]:
    """One sequence's keys and values in logical order, dequantized: two f32 [n * S, H, D]."""

    def g(a):  # this sequence's pages: [n, ...]
        return a[table]

    if pages.format == "dense":
        k, v = g(pages.k).astype(jnp.float32), g(pages.v).astype(jnp.float32)
    elif pages.is_kivi:
        k = F.dequantize_kivi_keys(g(pages.k), g(pages.k_scale), g(pages.k_zero), pages.bits)
        v = F.dequantize_kivi_values(g(pages.v), g(pages.v_scale), g(pages.v_zero), pages.bits)
        current = (jnp.arange(table.shape[0]) == length // pages.page_size)[:, None, None, None]
        k = jnp.where(current, pages.k_tail[slot].astype(jnp.float32), k)
        v = jnp.where(current, pages.v_tail[slot].astype(jnp.float32), v)
    else:
        dequantize = F.dequantize_int8 if pages.format == "int8" else F.dequantize_fp8
        k, v = dequantize(g(pages.k), g(pages.k_scale)), dequantize(g(pages.v), g(pages.v_scale))
    n, s = k.shape[:2]
    return k.reshape(n * s, *k.shape[2:]), v.reshape(n * s, *v.shape[2:])


def _one_sequence(q, k, v, length, query_pos, scale, opts, sink_logits, group):
    """q [T, Hq, Dh]; k, v f32 [S, Hkv, Dh] -> f32 [T, Hq, Dh]."""
    k = jnp.repeat(k, group, axis=1)  # [S, Hq, Dh]: the KV head each query head reads
    v = jnp.repeat(v, group, axis=1)
    key_pos = jnp.arange(k.shape[0])
    mask = visible(key_pos[None, :], query_pos[:, None], length, opts)  # [T, S]
    seen = jnp.any(mask, axis=0)  # keys no query sees may hold anything (NaN included)
    v = jnp.where(seen[:, None, None], v, 0.0)
    scores = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k) * scale
    scores = jnp.where(mask[None], cap_scores(scores, opts.soft_cap), -jnp.inf)
    if sink_logits is not None:
        sink = jnp.broadcast_to(sink_logits.astype(jnp.float32)[:, None, None], (*scores.shape[:2], 1))
        scores = jnp.concatenate([scores, sink], axis=-1)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with nothing visible: all weights 0
    weights = jnp.exp(scores - m)
    probs = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
    probs = probs[..., : k.shape[0]]  # the sink column takes weight but carries no value
    return jnp.einsum("hts,shd->thd", probs, v)
