"""`jaxinfer.forward` as a researcher calls it: shapes checked with errors that name the
argument, positions given once for every row, `num_new` kept within the row, numpy integers
as attention options."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import KVCacheSpec, forward
from jaxinfer.attention import paged_attention
from jaxinfer.kv import check_replica_pages, partition_pages
from tiny_models import kv_with_pages, random_tokens, tiny_model

SPEC = KVCacheSpec(num_pages=9, page_size=4, max_slots=2, max_pages_per_seq=4)
PAGES = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def call(model, tokens, positions, num_new=None, **kw):
    config, params = model
    return forward(params, config, tokens, positions, kv_with_pages(config, SPEC, PAGES), num_new, **kw)


def test_positions_given_once_serve_every_row(model):
    tokens = jnp.asarray(random_tokens((2, 5), 97))
    full, kv_full = call(model, tokens, jnp.broadcast_to(jnp.arange(5), (2, 5)), jnp.asarray([5, 3]))
    once, kv_once = call(model, tokens, jnp.arange(5), jnp.asarray([5, 3]))
    np.testing.assert_array_equal(np.asarray(full), np.asarray(once))
    assert kv_once.lengths.tolist() == kv_full.lengths.tolist() == [5, 3]


def test_num_new_beyond_the_row_is_clipped_to_it(model):
    """Values cannot raise under jit; a slot never claims tokens it was not given."""
    tokens = jnp.asarray(random_tokens((2, 4), 97))
    ref, kv_ref = call(model, tokens, jnp.arange(4), jnp.asarray([4, 0]))
    out, kv = call(model, tokens, jnp.arange(4), jnp.asarray([6, -1]))
    assert kv.lengths.tolist() == kv_ref.lengths.tolist() == [4, 0]
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))


def test_python_lists_are_arrays(model):
    out, kv = call(model, jnp.asarray(random_tokens((2, 4), 97)), jnp.arange(4), [4, 2])
    assert kv.lengths.tolist() == [4, 2] and out.shape == (2, 4, 97)


@pytest.mark.parametrize("case, needle", [
    (dict(tokens=np.zeros(4, np.int32)), "tokens must be i32[B, T], got int32[4]"),
    (dict(tokens=np.zeros((2, 4), np.float32)), "tokens must be i32[B, T], got float32[2, 4]"),
    (dict(positions=np.zeros((2, 5), np.int32)), "positions must be i32[2, 4]"),
    (dict(num_new=np.asarray(4)), "num_new must be i32[2]"),
    (dict(num_new=np.asarray([4, 4, 4])), "num_new must be i32[2]"),
    (dict(num_new=np.asarray([4.0, 2.0])), "num_new must be i32[2]"),
    (dict(logits_index=np.asarray([0, 1, 2])), "logits_index must be i32[2]"),
])
def test_bad_shapes_name_the_argument(model, case, needle):
    args = dict(tokens=np.zeros((2, 4), np.int32), positions=np.zeros((2, 4), np.int32), num_new=None) | case
    logits_index = args.pop("logits_index", None)
    with pytest.raises(ValueError) as e:
        call(model, jnp.asarray(args["tokens"]), jnp.asarray(args["positions"]), args["num_new"],
             logits_index=logits_index)
    assert needle in str(e.value)


def test_a_block_table_with_other_rows_than_lengths_is_refused(model):
    config, params = model
    kv = kv_with_pages(config, SPEC, PAGES)
    kv = kv.replace(block_tables=kv.block_tables[:1])
    with pytest.raises(ValueError, match="block_tables has 1 rows but kv.lengths 2"):
        forward(params, config, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), kv)


def test_pages_of_another_data_replica_are_named():
    """On a data=2 mesh slot 1 may hold only pages of replica 1 (`partition_pages`)."""
    parts = partition_pages(16, 2)
    check_replica_pages(np.asarray([[1, 2], [parts[1].start, 0]]), 16, 2)  # NULL_PAGE padding anywhere
    with pytest.raises(ValueError) as e:
        check_replica_pages(np.asarray([[1, 2], [3, 0]]), 16, 2)
    assert "slot 1 (data replica 1 of 2) holds page 3" in str(e.value)
    assert "partition_pages(16, 2)[slot // 1]" in str(e.value)


def test_numpy_integers_are_attention_options():
    rng = np.random.default_rng(0)
    config, _ = tiny_model()
    kv = kv_with_pages(config, SPEC, PAGES, fill=0.5)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 8)), jnp.float32)
    args = (q, kv.layers[0], kv.block_tables, jnp.asarray([6, 3]), jnp.asarray([[5], [2]]), 0.3)
    np.testing.assert_array_equal(np.asarray(paged_attention(*args, window=np.int64(3), num_sinks=np.int32(1))),
                                  np.asarray(paged_attention(*args, window=3, num_sinks=1)))
