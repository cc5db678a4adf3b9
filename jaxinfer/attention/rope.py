"""Rotary position embeddings: rotate query/key channel pairs by position (Llama 3.1 scaling too)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.config import LinearRopeScaling, RopeScaling, YarnRopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """f32[head_dim // 2]: the rotation frequency of each pair of channels."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between is interpolated smoothly (HF `_compute_llama3_parameters`).
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_medium, interpolated, scaled)


def _yarn_inv_freq(inv_freq: jax.Array, head_dim: int, theta: float, scaling: YarnRopeScaling) -> jax.Array:
    """YaRN (HF `_compute_yarn_parameters`): channels that turn more than `beta_fast` times over
    the original context keep their frequency, those turning fewer than `beta_slow` times are
    slowed by `factor`, with a linear ramp between. (Its attention factor: `ModelConfig.attention_scale`.)"""
    def correction_dim(rotations: float) -> float:  # the channel pair turning `rotations` times
        return head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # HF: no zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate x: [B, T, H, Dh] by positions: i32[B, T] (HF "rotate_half" channel pairing).

    Channel i is paired with channel i + Dh/2, which is the HF layout of q/k weights
    (GGUF's interleaved layout is un-permuted at load time).
    """
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
