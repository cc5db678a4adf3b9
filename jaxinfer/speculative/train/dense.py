"""The dense forward used for teaching and training: whole sequences, no paged cache.

The same layer math as `jaxinfer.model.forward_groups`, but differentiable and over padded
`[B, T]` batches; the teacher (the target) and the student (the draft) both run it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.layer_stack import unstack
from jaxinfer.model.layers import apply_rope, linear, rms_norm, rope_inv_freq, swiglu_mlp
from jaxinfer.model.params import LayerParams, ModelParams, lm_head_weight


def causal_mask(t: int, window: int | None) -> jax.Array:
    """bool[T, T]: query i sees key j iff j <= i (and i - j < window for a windowed layer)."""
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    mask = j <= i
    return mask if window is None else mask & (i - j < window)


def dense_attention(config: ModelConfig, layer: LayerParams, x: jax.Array, inv_freq: jax.Array,
                    mask: jax.Array) -> jax.Array:
    """Causal GQA self-attention over whole sequences, no cache: x f32[B, T, D] -> f32[B, T, D]."""
    c = config
    b, t, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # i32[B, T]
    q = linear(x, layer.wq, layer.bq).reshape(b, t, c.n_heads, c.head_dim)  # [B, T, H, Dh]
    k = linear(x, layer.wk, layer.bk).reshape(b, t, c.n_kv_heads, c.head_dim)  # [B, T, Hkv, Dh]
    v = linear(x, layer.wv, layer.bv).reshape(b, t, c.n_kv_heads, c.head_dim)  # [B, T, Hkv, Dh]
    # query head h reads KV head h // G (G = q_per_kv): split H into [Hkv, G]
    q = apply_rope(q, positions, inv_freq).reshape(b, t, c.n_kv_heads, c.q_per_kv, c.head_dim)  # [B, T, Hkv, G, Dh]
    k = apply_rope(k, positions, inv_freq)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(c.head_dim)
    scores = jnp.where(mask, scores, -jnp.inf)  # f32[B, Hkv, G, T, T]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)  # [B, T, Hkv, G, Dh]
    return linear(out.reshape(b, t, c.n_heads * c.head_dim), layer.wo)


def dense_streams(params: ModelParams, config: ModelConfig, tokens: jax.Array, layers: tuple[int, ...]) -> jax.Array:
    """The residual streams after `layers` (increasing indices): tokens i32[B, T] ->
    [B, T, len(layers), D] (`jaxinfer.model.forward_hidden`'s `taps` in serving).

    The same layer math as `transformer.forward_groups`, but dense and differentiable
    (no paged cache). Right-padding is harmless: position t sees only tokens <= t.
    """
    c = config
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    x = params.embed[tokens].astype(c.jnp_dtype)  # [B, T, D]
    streams = []
    for i, layer in enumerate(unstack(params.layers)[: max(layers) + 1]):
        mask = causal_mask(tokens.shape[1], c.window(i))
        x = x + dense_attention(c, layer, rms_norm(x, layer.attn_norm, c.rms_eps), inv_freq, mask)
        x = x + swiglu_mlp(rms_norm(x, layer.mlp_norm, c.rms_eps), layer.w_gate, layer.w_up, layer.w_down)
        if i in layers:
            streams.append(x)
    return jnp.stack(streams, axis=2)


def dense_features(params: ModelParams, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The residual stream after the last layer (before the final norm): tokens i32[B, T] ->
    [B, T, D], the features an EAGLE head reads (`jaxinfer.model.forward_hidden` in serving)."""
    return dense_streams(params, config, tokens, (config.n_layers - 1,))[:, :, 0]


def dense_hidden(params: ModelParams, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Final-normed hidden states of whole sequences: tokens i32[B, T] -> [B, T, D]."""
    return rms_norm(dense_features(params, config, tokens), params.final_norm, config.rms_eps)


def dense_logits(params: ModelParams, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens i32[B, T] -> logits f32[B, T, V] (V = the head's rows: a draft's subset)."""
    head = lm_head_weight(params)  # [V, D]
    return jnp.einsum("btd,vd->btv", dense_hidden(params, config, tokens), head, preferred_element_type=jnp.float32)
