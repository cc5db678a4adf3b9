"""Small pure building blocks of a Llama-family decoder layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.attention.rope import apply_rope, rope_inv_freq  # re-exported: RoPE lives with attention

__all__ = ["apply_rope", "geglu_mlp", "linear", "rms_norm", "rope_inv_freq", "swiglu_mlp"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., D], weight: [D]. Statistics in f32 whatever the input dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x: [..., K], w: [N, K] (HF layout) -> [..., N]."""
    y = jnp.einsum("...k,nk->...n", x, w)
    return y if b is None else y + b


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)); x: [..., D] -> [..., D]."""
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def geglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma's `gelu_pytorch_tanh`); x: [..., D] -> [..., D]."""
    return linear(jax.nn.gelu(linear(x, w_gate), approximate=True) * linear(x, w_up), w_down)
