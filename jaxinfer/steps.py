"""Jitted model steps that end in sampling: prefill a batch of prompts, decode one token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv.paged_state import PagedKVState
from jaxinfer.model import ModelParams, forward
from jaxinfer.sampling import SamplingArrays, sample_tokens


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("kv",))
def prefill_and_sample(
    params: ModelParams,
    config: ModelConfig,
    kv: PagedKVState,
    tokens: jax.Array,  # i32[B, T]: prompts, right-padded
    num_new: jax.Array,  # i32[B]: prompt lengths (0 for unused rows)
    sampling: SamplingArrays,
) -> tuple[jax.Array, PagedKVState]:
    """Append prompts to the cache and sample each row's first token -> (i32[B], kv)."""
    positions = kv.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    last = jnp.maximum(num_new - 1, 0)
    logits, kv = forward(params, config, tokens, positions, kv, num_new, logits_index=last)
    return sample_tokens(logits, sampling, kv.lengths), kv


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("kv",))
def decode_and_sample(
    params: ModelParams,
    config: ModelConfig,
    kv: PagedKVState,
    tokens: jax.Array,  # i32[B]: the last sampled token of each row
    active: jax.Array,  # bool[B]: rows still generating
    sampling: SamplingArrays,
) -> tuple[jax.Array, PagedKVState]:
    """Append one token per active row and sample the next -> (i32[B], kv)."""
    logits, kv = forward(
        params, config, tokens[:, None], kv.lengths[:, None], kv,
        active.astype(jnp.int32), logits_index=jnp.zeros_like(tokens),
    )
    return sample_tokens(logits, sampling, kv.lengths), kv
