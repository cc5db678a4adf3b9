"""The Llama-family forward pass over a paged KV cache, as one pure function."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv.paged_state import PagedKVState, WriteIndices, write_indices
from jaxinfer.model.attention import paged_attention_reference
from jaxinfer.model.layers import apply_rope, linear, rms_norm, rope_inv_freq, swiglu_mlp
from jaxinfer.model.params import LayerParams, ModelParams


def attention_block(
    config: ModelConfig,
    layer: LayerParams,
    layer_index: int,
    x: jax.Array,  # [B, T, D], already normed
    positions: jax.Array,  # i32[B, T]: RoPE positions
    inv_freq: jax.Array,  # f32[Dh/2]
    kv: PagedKVState,
    idx: WriteIndices,
) -> tuple[jax.Array, PagedKVState]:
    """Project, rotate, write this step's K/V into the pages, attend through them."""
    b, t, _ = x.shape
    q = linear(x, layer.wq, layer.bq).reshape(b, t, config.n_heads, config.head_dim)
    k = linear(x, layer.wk, layer.bk).reshape(b, t, config.n_kv_heads, config.head_dim)
    v = linear(x, layer.wv, layer.bv).reshape(b, t, config.n_kv_heads, config.head_dim)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    layer_kv = kv.layers[layer_index].write(k, v, idx)
    layers = kv.layers[:layer_index] + (layer_kv,) + kv.layers[layer_index + 1 :]
    kv = dataclasses.replace(kv, layers=layers)
    out = paged_attention_reference(
        q,
        layer_kv,
        kv.block_tables,
        idx.new_lengths,
        idx.cache_index,
        scale=1.0 / math.sqrt(config.head_dim),
    )
    return linear(out.reshape(b, t, -1), layer.wo), kv


def lm_head(params: ModelParams, x: jax.Array) -> jax.Array:
    """x: [..., D] -> f32 logits [..., V] (tied to the embedding when lm_head is None)."""
    w = params.embed if params.lm_head is None else params.lm_head
    return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("kv",))
def forward(
    params: ModelParams,
    config: ModelConfig,
    tokens: jax.Array,  # i32[B, T]; B == kv.max_slots, row b is slot b
    positions: jax.Array,  # i32[B, T]: RoPE positions of the tokens
    kv: PagedKVState,
    num_new: jax.Array | None = None,  # i32[B]: valid tokens per row (rest is padding)
    logits_index: jax.Array | None = None,  # i32[B]: compute logits only at this position
) -> tuple[jax.Array, PagedKVState]:
    """One model evaluation over a padded batch; donates `kv`.

    Row b appends its first `num_new[b]` tokens to slot b's cache (at cache positions
    `kv.lengths[b] ...`), attends causally over everything the slot has cached, and
    returns logits f32[B, T, V] (or f32[B, V] when `logits_index` is given) together
    with the cache holding the new K/V and the advanced lengths. A row with
    `num_new[b] == 0` writes nothing and leaves its slot untouched.
    """
    b, t = tokens.shape
    if b != kv.max_slots:
        raise ValueError(f"batch size {b} must equal the cache's max_slots={kv.max_slots}")
    if num_new is None:
        num_new = jnp.full((b,), t, jnp.int32)
    idx = write_indices(kv, num_new, t)
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    x = params.embed[tokens].astype(config.jnp_dtype)  # [B, T, D]
    for i, layer in enumerate(params.layers):  # unrolled: faster than scan on XLA:CPU
        h, kv = attention_block(
            config, layer, i, rms_norm(x, layer.attn_norm, config.rms_eps), positions, inv_freq, kv, idx
        )
        x = x + h
        x = x + swiglu_mlp(rms_norm(x, layer.mlp_norm, config.rms_eps), layer.w_gate, layer.w_up, layer.w_down)
    x = rms_norm(x, params.final_norm, config.rms_eps)
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]  # [B, D]
    return lm_head(params, x), dataclasses.replace(kv, lengths=idx.new_lengths)
