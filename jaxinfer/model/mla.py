"""DeepSeek-V2/V3 multi-head latent attention (MLA) over the latent paged cache.

Per token the cache holds c = RMSNorm(W_DKV x) (kv_lora_rank numbers) and one rotated
RoPE key k_r (qk_rope_dim) shared by all heads. Head h's key and value are
k_h = [W_UK[h] c ; k_r] and v_h = W_UV[h] c. Two equal ways to attend:

    expanded (prefill):  build k_h, v_h for every cached token, ordinary MHA.
    absorbed (decode):   q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_rope_h . k_r, so fold W_UK
                         into the query and attend in latent space: an MQA with one
                         "KV head" of width r + dr whose values are c itself; then
                         out_h = W_UV[h] (sum_j p_j c_j). Never materialises per-head K/V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv.latent import LatentKV
from jaxinfer.kv.paged_state import WriteIndices
from jaxinfer.model.attention import attention_output, attention_scores, visible_keys
from jaxinfer.model.layers import apply_rope, linear, rms_norm
from jaxinfer.model.params import MLALayerParams

# HF DeepSeek-V3 builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps,
# not `rms_norm_eps`.
MLA_NORM_EPS = 1e-6


def up_projections(config: ModelConfig, layer: MLALayerParams) -> tuple[jax.Array, jax.Array]:
    """wkv_b -> (W_UK: [H, dn, r], W_UV: [H, dv, r])."""
    m = config.mla
    wkv_b = layer.wkv_b.reshape(config.n_heads, m.qk_nope_dim + m.v_head_dim, m.kv_lora_rank)
    return wkv_b[:, : m.qk_nope_dim], wkv_b[:, m.qk_nope_dim :]


def mla_attention_reference(
    q_nope: jax.Array,  # [B, T, H, dn]
    q_rope: jax.Array,  # [B, T, H, dr]: rotated
    latent: LatentKV,  # this step's tokens already written
    w_uk: jax.Array,  # [H, dn, r]
    w_uv: jax.Array,  # [H, dv, r]
    block_tables: jax.Array,  # i32[B, max_pages]
    kv_lengths: jax.Array,  # i32[B]: cached tokens, this step's included
    query_index: jax.Array,  # i32[B, T]
    scale: float,
    *,
    absorb: bool,
) -> jax.Array:
    """Causal MLA through block tables -> [B, T, H, dv] (dtype of q_nope); see the module docstring."""
    c, k_rope = latent.gather(block_tables)  # [B, S, r], [B, S, dr]
    key_index = jnp.arange(c.shape[1], dtype=jnp.int32)[None, :]
    visible = visible_keys(key_index, kv_lengths, query_index)
    if absorb:
        q_latent = jnp.einsum("bthn,hnr->bthr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)
        q = jnp.concatenate([q_latent, q_rope], axis=-1)  # [B, T, H, r + dr]
        k = jnp.concatenate([c, k_rope], axis=-1)[:, :, None, :]  # [B, S, 1, r + dr]
        out_latent = attention_output(attention_scores(q, k, scale), c[:, :, None, :], visible)  # [B, T, H, r]
        out = jnp.einsum("bthr,hvr->bthv", out_latent.astype(w_uv.dtype), w_uv, preferred_element_type=jnp.float32)
        return out.astype(q_nope.dtype)
    h = q_nope.shape[2]
    k_nope = jnp.einsum("bsr,hnr->bshn", c, w_uk, preferred_element_type=jnp.float32).astype(c.dtype)
    v = jnp.einsum("bsr,hvr->bshv", c, w_uv, preferred_element_type=jnp.float32).astype(c.dtype)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (*k_rope.shape[:2], h, k_rope.shape[-1]))], axis=-1)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    return attention_output(attention_scores(q, k, scale), v, visible).astype(q_nope.dtype)


def mla_attention(
    config: ModelConfig,
    layer: MLALayerParams,
    xs: list[jax.Array],  # per group [B, T, D], normed
    positions: list[jax.Array],  # per group i32[B, T]
    idxs: list[WriteIndices],
    inv_freq: jax.Array,  # f32[dr / 2]
    latent: LatentKV,
) -> tuple[list[jax.Array], LatentKV]:
    """Project, write every group's latents, attend per group -> ([B, T, H * dv] per group, cache).

    Groups with one token per row (decode) use the absorbed form, longer ones the expanded form.
    """
    m, h = config.mla, config.n_heads
    w_uk, w_uv = up_projections(config, layer)
    queries = []
    for x, pos, idx in zip(xs, positions, idxs):
        if layer.wq is not None:
            q = linear(x, layer.wq)
        else:
            q = linear(rms_norm(linear(x, layer.wq_a), layer.q_a_norm, MLA_NORM_EPS), layer.wq_b)
        q = q.reshape(*x.shape[:2], h, m.qk_head_dim)
        queries.append((q[..., : m.qk_nope_dim], apply_rope(q[..., m.qk_nope_dim :], pos, inv_freq)))
        compressed = linear(x, layer.wkv_a)  # [B, T, r + dr]
        c = rms_norm(compressed[..., : m.kv_lora_rank], layer.kv_a_norm, MLA_NORM_EPS)
        k_rope = apply_rope(compressed[..., None, m.kv_lora_rank :], pos, inv_freq)[:, :, 0]
        latent = latent.write(c, k_rope, idx)  # all writes first: groups are distinct slots
    scale = m.qk_head_dim ** -0.5
    outs = [
        mla_attention_reference(q_nope, q_rope, latent, w_uk, w_uv, idx.block_tables, idx.new_lengths,
                                idx.cache_index, scale, absorb=x.shape[1] == 1).reshape(*x.shape[:2], -1)
        for (q_nope, q_rope), x, idx in zip(queries, xs, idxs)
    ]
    return outs, latent
