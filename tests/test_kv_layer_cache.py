"""Every cache format behind the one `LayerCache` protocol: write, gather, bytes per token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import MLAConfig
from jaxinfer.kv import FORMAT_NAMES, KVCacheSpec, LatentKV, LayerCache, make_layer_kv
from jaxinfer.kv.formats import get_format
from jaxinfer.kv.layer_cache import one_shot_round_trip
from jaxinfer.kv.pages import WriteIndices

# num_pages != max_slots, so a leaf's leading axis says whether it is pool or per-slot
SPEC = KVCacheSpec(num_pages=9, page_size=4, max_slots=3, max_pages_per_seq=2)
HKV, DH = 2, 8


def _layers() -> dict[str, LayerCache]:
    layers = {name: make_layer_kv(name, SPEC, HKV, DH, jnp.float32) for name in FORMAT_NAMES}
    mla = MLAConfig(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=6)
    layers["mla_latent"] = LatentKV.zeros(mla, SPEC, jnp.bfloat16)
    return layers


@pytest.mark.parametrize("name", [*FORMAT_NAMES, "mla_latent"])
def test_every_format_implements_the_protocol(name):
    layer = _layers()[name]
    assert isinstance(layer, LayerCache)
    assert isinstance(layer.splits_over_mesh, bool)
    # what the pool's arrays take per token slot (per-slot KIVI tails are not pool)
    pool = [a for a in jax.tree.leaves(layer) if a.shape[0] == SPEC.num_pages]
    pool_bytes = sum(a.size * a.dtype.itemsize for a in pool) / (SPEC.num_pages * SPEC.page_size)
    assert layer.bytes_per_token() == pytest.approx(pool_bytes)
    if name != "mla_latent":
        assert layer.bytes_per_token() == pytest.approx(get_format(name).bytes_per_token(HKV, DH, SPEC.page_size))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_write_then_gather_returns_what_one_shot_round_trip_promises(name):
    """Two rows written through `write` at scattered pages read back (via `gather`) as the format's
    one-shot round trip of the same tokens; the rest of the pool is untouched."""
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.normal(size=(2, 8, HKV, DH)), jnp.float32) for _ in range(2))
    layer = make_layer_kv(name, SPEC, HKV, DH, jnp.float32)
    tables = jnp.array([[5, 2], [7, 3]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    idx = WriteIndices(slots=jnp.array([2, 0], jnp.int32), block_tables=tables,
                       page_ids=jnp.take_along_axis(tables, pos // 4, axis=1), offsets=pos % 4, cache_index=pos,
                       new_lengths=jnp.array([8, 8], jnp.int32))
    written = layer.write(k, v, idx)
    got_k, got_v = written.gather(tables, idx.new_lengths, idx.slots)
    want_k, want_v = one_shot_round_trip(name, k, v, SPEC.page_size, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
    untouched = [p for p in range(SPEC.num_pages) if p not in (5, 2, 7, 3)]
    for leaf in jax.tree.leaves(written):
        if leaf.shape[0] == SPEC.num_pages:
            assert not np.asarray(leaf[jnp.array(untouched)], np.float32).any()
