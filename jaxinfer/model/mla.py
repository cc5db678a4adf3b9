"""DeepSeek-V2/V3 multi-head latent attention (MLA): the projections around the latent cache.

The attention itself goes through `jaxinfer.attention.dispatch.mla_attention` (reference:
`jaxinfer.attention.reference.mla_attention_reference`).

Per token the cache holds c = RMSNorm(W_DKV x) (kv_lora_rank numbers) and one rotated
RoPE key k_r (qk_rope_dim) shared by all heads; head h's key is [W_UK[h] c ; k_r] and its
value W_UV[h] c. Decode attends in latent space (W_UK absorbed into the query, W_UV into
the output), longer chunks expand per-head keys and values (the reference's docstring).
"""

from __future__ import annotations

import jax

from jaxinfer.attention import dispatch
from jaxinfer.attention.rope import apply_rope
from jaxinfer.config import ModelConfig
from jaxinfer.kv.latent import LatentKV
from jaxinfer.kv.pages import WriteIndices
from jaxinfer.model.layers import linear, rms_norm
from jaxinfer.model.params import MLALayerParams

# HF DeepSeek-V3 builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps,
# not `rms_norm_eps`.
MLA_NORM_EPS = 1e-6


def up_projections(config: ModelConfig, layer: MLALayerParams) -> tuple[jax.Array, jax.Array]:
    """wkv_b -> (W_UK: [H, dn, r], W_UV: [H, dv, r])."""
    m = config.mla
    wkv_b = layer.wkv_b.reshape(config.n_heads, m.qk_nope_dim + m.v_head_dim, m.kv_lora_rank)
    return wkv_b[:, : m.qk_nope_dim], wkv_b[:, m.qk_nope_dim :]


def mla_attention(
    config: ModelConfig,
    layer: MLALayerParams,
    xs: list[jax.Array],  # per group [B, T, D], normed
    positions: list[jax.Array],  # per group i32[B, T]
    idxs: list[WriteIndices],
    inv_freq: jax.Array,  # f32[dr / 2]
    latent: LatentKV,
    impl: str = "auto",  # `jaxinfer.attention.dispatch`: decode runs the MLA kernel of a kernel impl
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
        dispatch.mla_attention(q_nope, q_rope, latent, w_uk, w_uv, idx.block_tables, idx.new_lengths,
                               idx.cache_index, scale, absorb=x.shape[1] == 1, impl=impl).reshape(*x.shape[:2], -1)
        for (q_nope, q_rope), x, idx in zip(queries, xs, idxs)
    ]
    return outs, latent
