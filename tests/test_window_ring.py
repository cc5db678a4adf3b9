"""Windowed layers of a hybrid model in a bounded ring of pages per slot (`jaxinfer.kv.window_ring`):
the ring's view always holds every key a step's queries may see, and a model run through rings
gives the logits and greedy tokens of the unbounded cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.config import MoEConfig
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.kv.pages import NULL_PAGE, WriteIndices
from jaxinfer.kv.window_ring import ring_indices, ring_pages, ring_pool_pages, ring_tables
from jaxinfer.model import forward
from tiny_models import tiny_model

GEMMA_TINY = dict(arch="gemma3", n_layers=4, layer_windows=(8, 8, None, 8), head_dim=16, query_scale=0.2,
                  rope_local_theta=100.0)
# gpt-oss layers (learned sinks, biases, experts), windowed and global alternating
GPT_OSS_TINY = dict(arch="gpt_oss", n_layers=4, layer_windows=(6, None, 6, None), attn_sinks=True, attn_bias=True,
                    moe=MoEConfig(n_experts=4, experts_per_token=2, expert_dim=16))


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 40), page_size=st.integers(1, 8), chunk=st.integers(1, 12), cached=st.integers(0, 200),
       data=st.data())
def test_ring_view_holds_every_visible_key(window, page_size, chunk, cached, data):
    """For a step appending n <= chunk tokens after `cached`: each new token is written to the
    view page and offset its shifted position names, and every key a query of the step may see
    (cache positions > query - window, < new length) sits in the view at its shifted position
    in the ring page that logical page maps to, never sharing a ring page with another live page."""
    n = data.draw(st.integers(1, chunk))
    ring = ring_pages(window, chunk, page_size)
    pool = ring_pool_pages(3, ring)
    tables = jnp.asarray(ring_tables(3, ring))
    t = np.arange(chunk)
    cache_index = cached + t
    idx = WriteIndices(slots=jnp.asarray([1]), block_tables=jnp.zeros((1, 1), jnp.int32),
                       page_ids=jnp.zeros((1, chunk), jnp.int32), offsets=jnp.asarray(cache_index % page_size)[None],
                       cache_index=jnp.asarray(cache_index)[None], new_lengths=jnp.asarray([cached + n]))
    r = ring_indices(idx, tables, page_size, pool)
    view, shift = np.asarray(r.block_tables[0]), int(cache_index[0] - r.cache_index[0, 0])
    assert shift % page_size == 0 and int(r.new_lengths[0]) == cached + n - shift <= ring * page_size
    own = set(np.asarray(tables[1]).tolist())
    assert set(view.tolist()) == own and NULL_PAGE not in own  # the slot's own pages, each once
    page_ids = np.asarray(r.page_ids[0])
    for i in range(chunk):
        if i < n:
            assert page_ids[i] == view[(cache_index[i] - shift) // page_size]
        else:
            assert page_ids[i] == pool  # padding: dropped
    live = [j for j in range(cached + n) if j > cached - window]  # keys the step's first query onwards may see
    logical_of_ring = {}
    for j in live:
        assert 0 <= j - shift < ring * page_size
        page = view[(j - shift) // page_size]
        assert logical_of_ring.setdefault(page, j // page_size) == j // page_size
        assert page == tables[1, (j // page_size) % ring]


@pytest.mark.parametrize("max_slots,ring,replicas", [(3, 4, 1), (4, 3, 2), (8, 5, 4)])
def test_ring_tables_give_each_replica_a_block_of_the_pool(max_slots, ring, replicas):
    """Each slot's ring lies in its data replica's equal share of the pool (the pages a mesh's
    `data` axis puts on that replica's devices), rings never overlap, NULL_PAGE is no one's."""
    pool = ring_pool_pages(max_slots, ring, replicas)
    tables = ring_tables(max_slots, ring, replicas)
    assert pool % replicas == 0 and tables.shape == (max_slots, ring)
    assert len(set(tables.ravel().tolist())) == tables.size and NULL_PAGE not in tables and tables.max() < pool
    replica_of_page = tables // (pool // replicas)  # [max_slots, ring]
    assert (replica_of_page == (np.arange(max_slots) // (max_slots // replicas))[:, None]).all()


def run_chunks(params, config, kv, tokens: np.ndarray, chunk: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill tokens [B, T] in chunks, then greedy-decode 12 tokens -> (last logits per step, greedy tokens of row 0)."""
    b, t = tokens.shape
    out = []
    for start in range(0, t, chunk):
        part = tokens[:, start : start + chunk]
        pos = start + np.arange(part.shape[1])[None].repeat(b, 0)
        logits, kv = forward(params, config, jnp.asarray(part), jnp.asarray(pos), kv)
        out.append(np.asarray(logits))
    greedy, last = [], out[-1][:, -1]
    for i in range(t, t + 12):
        nxt = last.argmax(-1).astype(np.int32)
        greedy.append(int(nxt[0]))
        logits, kv = forward(params, config, jnp.asarray(nxt[:, None]), jnp.full((b, 1), i), kv)
        last = np.asarray(logits[:, 0])
        out.append(last)
    return out, greedy


@pytest.mark.parametrize("kv_cache", ["auto", "int8"])
def test_ring_forward_equals_unbounded_cache(kv_cache):
    config, params = tiny_model(**GEMMA_TINY)
    chunk, page_size, b = 5, 4, 2
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (b, 45)).astype(np.int32)
    spec = KVCacheSpec.for_batch(b, 45 + 12, page_size=page_size)
    tables = np.arange(1, spec.num_pages, dtype=np.int32)[::-1].reshape(b, -1)  # scattered pages
    full = init_paged_kv(config, spec, kv_cache=kv_cache).replace(block_tables=jnp.asarray(tables))
    ring = ring_pages(8, chunk, page_size)  # ceil(12 / 4) + 1 = 4 pages: 16 tokens per slot per windowed layer
    bounded = init_paged_kv(config, spec, kv_cache=kv_cache, window_ring=ring).replace(block_tables=jnp.asarray(tables))
    pools = [jax.tree.leaves(layer)[0].shape[0] for layer in bounded.layers]
    assert pools == [b * ring + 1, b * ring + 1, spec.num_pages, b * ring + 1] and bounded.num_pages == spec.num_pages
    want, want_greedy = run_chunks(params, config, full, tokens, chunk)
    got, got_greedy = run_chunks(params, config, bounded, tokens, chunk)
    assert got_greedy == want_greedy
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)


def test_ring_needs_a_hybrid_model():
    config, _ = tiny_model(arch="gemma3", n_layers=2, layer_windows=(8, 8), head_dim=16)
    with pytest.raises(ValueError, match="both windowed and global layers"):
        init_paged_kv(config, KVCacheSpec.for_batch(1, 32, page_size=4), window_ring=4)
