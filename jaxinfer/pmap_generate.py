"""`pmap_generate`: greedy data-parallel generation built on `jax.pmap`.

For code written around `pmap` (one program per device, a leading device axis on every
array). The engine with `EngineConfig(mesh=...)` is the main multi-device path; this is
the small, explicit alternative::

    from jaxinfer.pmap_generate import pmap_generate
    out = pmap_generate(model, [[1, 2, 3], [4, 5]], max_tokens=16)   # every local device
    out.tokens        # list[list[int]]: generated ids per prompt (up to and incl. EOS)
    out.first_logits  # f32[n_prompts, V]: logits after each prompt

Prompts are dealt out to devices in contiguous groups of `per_device` (padded with a
one-token dummy prompt); each device holds a replica of the weights and its own paged
cache, in which slot b owns pages 1 + b * pages_per_seq ... (page 0 is NULL_PAGE)::

    devices:   d0            d1            ...
    prompts:   [p0 p1]       [p2 p3]       ...     per_device = 2
    step:      prefill (one [per_device, L] group), then max_tokens - 1 decode steps
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv import KVCacheSpec, block_table_array, init_paged_kv
from jaxinfer.model import TokenGroup, forward_groups


@dataclasses.dataclass(frozen=True)
class PmapOutput:
    tokens: list[list[int]]  # generated ids per prompt, cut after the first EOS
    first_logits: np.ndarray  # f32[n_prompts, V]: logits at each prompt's last token


def pmap_generate(model, prompts: list[list[int]], max_tokens: int, devices: list | None = None,
                  page_size: int = 16, kv_cache="auto") -> PmapOutput:
    """Greedy-decode `prompts` (token-id lists) with one `jax.pmap` replica per device;
    `kv_cache`: the cache's format(s), as `init_paged_kv` takes them (a name, a plan, ...)."""
    config: ModelConfig = model.config
    devices = list(jax.local_devices() if devices is None else devices)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be a positive integer")
    n_dev = len(devices)
    per = -(-len(prompts) // n_dev)
    padded = list(prompts) + [[0]] * (n_dev * per - len(prompts))
    width = max(len(p) for p in padded)
    if width + max_tokens > config.max_position:
        raise ValueError(f"prompt of {width} tokens + {max_tokens=} exceeds the model's context {config.max_position}")
    tokens = np.zeros((n_dev, per, width), np.int32)
    num_new = np.array([len(p) for p in padded], np.int32).reshape(n_dev, per)
    for i, p in enumerate(padded):
        tokens[i // per, i % per, : len(p)] = p

    spec = KVCacheSpec.for_batch(per, width + max_tokens, page_size)
    pps = spec.max_pages_per_seq
    kv = init_paged_kv(config, spec, kv_cache=kv_cache).replace(block_tables=jnp.asarray(
        block_table_array([list(range(1 + b * pps, 1 + (b + 1) * pps)) for b in range(per)], pps)))
    params, kv = _replicate(model.params, devices), _replicate(kv, devices)

    prefill, decode = _programs(config, tuple(devices))
    logits, kv = prefill(params, kv, jnp.asarray(tokens), jnp.asarray(num_new))
    first_logits = np.asarray(logits).reshape(n_dev * per, -1)
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    steps = [np.asarray(nxt)]
    for _ in range(max_tokens - 1):
        nxt, kv = decode(params, kv, nxt)
        steps.append(np.asarray(nxt))
    generated = np.stack(steps, axis=-1).reshape(n_dev * per, max_tokens)
    return PmapOutput(tokens=[_cut_at_eos(list(map(int, row)), config.eos_ids) for row in generated[: len(prompts)]],
                      first_logits=first_logits[: len(prompts)])


@functools.lru_cache(maxsize=8)
def _programs(config: ModelConfig, devices: tuple):
    """The pmapped prefill and decode programs for `config` (compiled once per shape)."""

    def prefill(params, kv, tokens, num_new):  # tokens: i32[B, L], num_new: i32[B]
        b, length = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
        group = TokenGroup(tokens, positions, jnp.arange(b, dtype=jnp.int32), num_new,
                           logits_index=jnp.maximum(num_new - 1, 0))
        (logits,), kv = forward_groups(params, config, kv, (group,))
        return logits, kv

    def decode(params, kv, last):  # last: i32[B], the previous token of every slot
        b = last.shape[0]
        group = TokenGroup(last[:, None], kv.lengths[:, None], jnp.arange(b, dtype=jnp.int32),
                           jnp.ones((b,), jnp.int32), logits_index=jnp.zeros((b,), jnp.int32))
        (logits,), kv = forward_groups(params, config, kv, (group,))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv

    return (jax.pmap(prefill, axis_name="data", devices=devices),
            jax.pmap(decode, axis_name="data", devices=devices, donate_argnums=(1,)))


def _replicate(tree, devices: list):
    """One copy of every leaf per device: a pmap-sharded [n_devices, ...] array."""
    stacked = jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (len(devices), *np.shape(a))), tree)
    return jax.pmap(lambda x: x, devices=devices)(stacked)


def _cut_at_eos(tokens: list[int], eos_ids) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens
