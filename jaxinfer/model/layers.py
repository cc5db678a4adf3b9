"""Small pure building blocks of a Llama-family decoder layer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.attention.rope import apply_rope, rope_inv_freq  # re-exported: RoPE lives with attention

__all__ = ["TwoLayoutWeight", "apply_rope", "geglu_mlp", "linear", "linears", "rms_norm", "rope_inv_freq", "swiglu_mlp"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., D], weight: [D]. Statistics in f32 whatever the input dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


@struct.dataclass
class TwoLayoutWeight:
    """A linear weight kept in both layouts, for XLA:CPU (`with_gemm_weights`): one-row products
    read `nk` as a gemv at memory speed; products of 2+ rows multiply `kn` directly, where
    from `nk` XLA:CPU's GEMM re-lays the weight out every call (M = 5: 1.45x, M = 16: 1.3x
    faster this way on the CI machine). Twice the weight's memory."""

    nk: jax.Array  # [..., N, K]: the HF layout
    kn: jax.Array  # [..., K, N]: the same weight transposed


def linear(x: jax.Array, w: jax.Array | TwoLayoutWeight, b: jax.Array | None = None, *,
           preferred_element_type=None) -> jax.Array:
    """x: [..., K], w: [N, K] (HF layout) -> [..., N].

    A single row (a batch-1 decode step) is written `x @ w.T`: XLA:CPU fuses that transpose
    into its multi-threaded gemv, which reads w at memory speed, where the einsum (or a
    dot_general contracting w's last axis) becomes a plain dot thunk 20-30 % slower
    (BENCHMARKS.md, "Decode at the hardware limit"). More rows use `TwoLayoutWeight.kn` when
    the weight carries it."""
    rows = math.prod(x.shape[:-1])
    if rows > 1 and isinstance(w, TwoLayoutWeight):
        y = jnp.matmul(x, w.kn, preferred_element_type=preferred_element_type)
    elif rows == 1:
        w = w.nk if isinstance(w, TwoLayoutWeight) else w
        y = jnp.matmul(x.reshape(1, -1), w.T, preferred_element_type=preferred_element_type).reshape(*x.shape[:-1], -1)
    else:
        y = jnp.einsum("...k,nk->...n", x, w, preferred_element_type=preferred_element_type)
    return y if b is None else y + b


def linears(x: jax.Array, ws: tuple[jax.Array | TwoLayoutWeight, ...],
            bs: tuple[jax.Array | None, ...] | None = None) -> list[jax.Array]:
    """[linear(x, w, b) for w, b in zip(ws, bs)]. For a single row, one gemv (and one bias add) over
    the weights concatenated inside the program: XLA:CPU fuses the concatenation into the
    gemv's reads (nothing is copied), and one large multi-threaded read beats several small
    ones (q, k, v of SmolLM2: 2.9 -> 2.1 ms a step). More rows would copy the weights: separate."""
    bs = bs or (None,) * len(ws)
    if math.prod(x.shape[:-1]) != 1:
        return [linear(x, w, b) for w, b in zip(ws, bs)]
    ws = [w.nk if isinstance(w, TwoLayoutWeight) else w for w in ws]
    b = None if all(b is None for b in bs) else jnp.concatenate(
        [jnp.zeros(w.shape[0], w.dtype) if b is None else b for w, b in zip(ws, bs)])
    y = linear(x, jnp.concatenate(ws), b)
    return jnp.split(y, np.cumsum([w.shape[0] for w in ws[:-1]]), axis=-1)


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)); x: [..., D] -> [..., D]."""
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def geglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma's `gelu_pytorch_tanh`); x: [..., D] -> [..., D]."""
    return linear(jax.nn.gelu(linear(x, w_gate), approximate=True) * linear(x, w_up), w_down)
