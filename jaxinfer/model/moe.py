"""A sparse mixture-of-experts MLP (gpt-oss, Mixtral, Qwen3-MoE): a router picks each token's
experts, each a gated MLP (gpt-oss: a clamped SwiGLU with biases), and their outputs are summed
with the router's weights.

The experts of every token are gathered (`w[indices]`): each token reads only its k experts'
weights, which is what decoding wants (a step has few tokens). A long prefill chunk gathers a
copy per token (N x k expert matrices); grouping tokens by expert (a sorted dispatch, as
grouped-GEMM kernels do) is the next step for large prefills.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import MoEConfig
from jaxinfer.model.layers import linear


def route(x: jax.Array, router: jax.Array, router_bias: jax.Array | None, k: int,
          normalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """x [N, D], router [E, D], router_bias [E] or None -> (expert ids i32[N, k], weights [N, k]):
    the k largest router logits, softmax-normalised among themselves (`normalize`), or their
    probabilities under the softmax over all E experts."""
    logits = linear(x, router, router_bias).astype(jnp.float32)  # [N, E]
    top, experts = jax.lax.top_k(logits, k)
    if normalize:
        weights = jax.nn.softmax(top, axis=-1)
    else:
        weights = jnp.exp(top - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    return experts, weights.astype(x.dtype)


def clamped_swiglu(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """[..., 2I] with gate and up columns alternating -> [..., I]:
    (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


def swiglu(gate_up: jax.Array) -> jax.Array:
    """[..., 2I] with gate and up columns alternating -> [..., I]: silu(gate) * up."""
    return jax.nn.silu(gate_up[..., ::2]) * gate_up[..., 1::2]


def moe_mlp(x: jax.Array, layer, moe: MoEConfig) -> jax.Array:
    """x [N, D] -> [N, D] with `layer`'s `moe_*` weights (`jaxinfer.model.params.LayerParams`)."""
    experts, weights = route(x, layer.moe_router, layer.moe_router_bias, moe.experts_per_token,
                             moe.normalize_weights)  # [N, k]
    h = jnp.einsum("nd,nkdf->nkf", x, layer.moe_gate_up[experts])  # [N, k, 2I]
    if moe.bias:
        h = h + layer.moe_gate_up_bias[experts]
    h = clamped_swiglu(h, moe.swiglu_alpha, moe.swiglu_limit) if moe.activation == "clamped_swiglu" else swiglu(h)
    out = jnp.einsum("nkf,nkfd->nkd", h, layer.moe_down[experts])  # [N, k, D]
    if moe.bias:
        out = out + layer.moe_down_bias[experts]
    return jnp.einsum("nkd,nk->nd", out, weights)
