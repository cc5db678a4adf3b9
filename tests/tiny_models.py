"""Tiny random models shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv import KVCacheSpec, PagedKVState, block_table_array, init_paged_kv
from jaxinfer.model import init_random_params


def tiny_config(n_heads: int = 4, n_kv_heads: int = 2, **changes) -> ModelConfig:
    fields = dict(arch="llama", vocab_size=97, d_model=32, n_layers=2, n_heads=n_heads,
                  n_kv_heads=n_kv_heads, head_dim=8, ffn_dim=48, rope_theta=10000.0, max_position=256)
    return ModelConfig(**(fields | changes))


def tiny_model(seed: int = 0, **changes):
    config = tiny_config(**changes)
    # Larger weights than the default init so logits differ clearly between tokens.
    return config, init_random_params(config, seed=seed, scale=0.3)


def kv_with_pages(config: ModelConfig, spec: KVCacheSpec, pages_per_slot: list[list[int]],
                  fill: float = 0.0) -> PagedKVState:
    """A cache whose block tables hold the given pages; every page pre-filled with `fill`."""
    kv = init_paged_kv(config, spec)
    return kv.replace(
        layers=jax.tree.map(lambda a: jnp.full_like(a, fill), kv.layers),
        block_tables=jnp.asarray(block_table_array(pages_per_slot, spec.max_pages_per_seq)),
    )


def random_tokens(shape, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)
