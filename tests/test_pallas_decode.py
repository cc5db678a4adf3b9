"""Paged decode kernels (GPU-style and TPU-style) in interpret mode against jaxinfer's reference.

Every case: 4 sequences of lengths 0, 1, page_size and page_size + 1 (or longer ones for the
window cases), permuted block tables, NaN in everything no sequence may read (pallas_cases).
Tolerances per dtype are stated in pallas_cases.TOLERANCES.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_cases import PAGE, assert_close, make_case, reference
from pallas_kernels.common import AttentionOptions
from pallas_kernels.formats import from_layer_kv
from pallas_kernels.paged_decode_gpu import paged_decode_gpu
from pallas_kernels.paged_decode_tpu import paged_decode_tpu

EDGE_LENGTHS = [0, 1, PAGE, PAGE + 1]
OPTIONS = dict(window=5, num_sinks=2, soft_cap=4.0)
SINKS = jnp.array([0.3, -2.0, 1.5, 0.0])


def _run(kernel, case, opts=AttentionOptions(), sink_logits=None, **kw):
    out = kernel(case.q[:, 0], from_layer_kv(case.layer), case.block_tables, case.lengths, case.query_index[:, 0],
                 sink_logits, case.slots, scale=case.scale, opts=opts, interpret=kw.pop("interpret", True), **kw)
    return out[:, None]


@pytest.mark.parametrize("fmt,dtype", [
    ("dense", "float32"), ("dense", "bfloat16"), ("int8", "float32"), ("int8", "bfloat16"),
    ("fp8_e4m3", "float32"), ("fp8_e5m2", "float32"), ("int4", "float32"), ("int2", "float32"),
])
def test_gpu_decode_every_format(fmt, dtype):
    case = make_case(fmt, dtype, EDGE_LENGTHS)
    assert_close(_run(paged_decode_gpu, case), reference(case), dtype)


@pytest.mark.parametrize("kernel", [paged_decode_gpu, paged_decode_tpu])
def test_kivi_pages_need_the_rows_slots(kernel):
    """A KIVI sequence's current page is in its slot's tail, and row b is not slot b: without
    `slots` the kernel refuses, as the dispatch does (it read other slots' tails). Other formats
    read no tail: rows are their own slots."""
    case = make_case("int4", "float32", [5, 9])
    pages = from_layer_kv(case.layer)
    with pytest.raises(ValueError, match="pass slots="):
        kernel(case.q[:, 0], pages, case.block_tables, case.lengths, case.query_index[:, 0], scale=case.scale,
               interpret=True)
    dense = make_case("dense", "float32", [5, 9])
    out = kernel(dense.q[:, 0], from_layer_kv(dense.layer), dense.block_tables, dense.lengths, dense.query_index[:, 0],
                 scale=dense.scale, interpret=True)
    assert_close(out[:, None], reference(dense), "float32")


@pytest.mark.parametrize("fmt", ["dense", "int4"])
def test_gpu_decode_window_sinks_softcap_split_k(fmt):
    """Sliding window + sink tokens + soft cap + sink logits; pages wholly behind the window are
    poisoned (they must not be read), and the key axis is split over 3 programs (flash-decoding)."""
    case = make_case(fmt, "float32", [13, 16, 14, 6], poison_pages=[(0, 1), (1, 1), (2, 1)])
    out = _run(paged_decode_gpu, case, AttentionOptions(**OPTIONS), SINKS, k_splits=3, pages_per_block=1)
    assert_close(out, reference(case, sink_logits=SINKS, **OPTIONS), "float32")


def test_tpu_decode_edge_lengths():
    """TPU-style kernel under the TPU interpreter (scalar prefetch drives the page index maps)."""
    case = make_case("dense", "float32", EDGE_LENGTHS)
    assert_close(_run(paged_decode_tpu, case, interpret=pltpu.InterpretParams()), reference(case), "float32")


def test_tpu_decode_kivi_window_sinks_softcap():
    case = make_case("int4", "float32", [13, 16, 14, 6], poison_pages=[(0, 1), (1, 1), (2, 1)])
    out = _run(paged_decode_tpu, case, AttentionOptions(**OPTIONS), SINKS)
    assert_close(out, reference(case, sink_logits=SINKS, **OPTIONS), "float32")


# Production-like sizes: head_dim 128, page 16, 32 query / 8 KV heads (GQA 4) or MQA 8 / 1.
# Lengths 1, a page, a page + 1 and 40 over 3 pages per sequence; NaN outside what each may read.
PROD = dict(head_dim=128, page=16, max_pages=3)
PROD_LENGTHS = [1, 16, 17, 40]


@pytest.mark.parametrize("fmt,dtype,heads", [
    ("dense", "bfloat16", (32, 8)), ("int8", "float32", (32, 8)), ("fp8_e4m3", "float32", (8, 1)),
    ("int4", "float32", (32, 8)), ("int2", "float32", (8, 1)),
])
def test_gpu_decode_production_shapes(fmt, dtype, heads):
    case = make_case(fmt, dtype, PROD_LENGTHS, heads=heads, **PROD)
    assert_close(_run(paged_decode_gpu, case), reference(case), dtype)


@pytest.mark.parametrize("fmt,dtype,heads", [("dense", "bfloat16", (32, 8)), ("int4", "float32", (8, 1))])
def test_tpu_decode_production_shapes(fmt, dtype, heads):
    case = make_case(fmt, dtype, PROD_LENGTHS, heads=heads, **PROD)
    assert_close(_run(paged_decode_tpu, case), reference(case), dtype)


def test_decode_production_window_sinks_softcap():
    """Window 8 + 4 sinks + soft-cap + sink logits at head_dim 128: the page wholly between
    the sinks and the window of sequence 0 (length 40) is poisoned, both targets skip it."""
    case = make_case("int8", "float32", [40, 17], heads=(8, 1), poison_pages=[(0, 1)], **PROD)
    opts, sinks = dict(window=8, num_sinks=4, soft_cap=30.0), jnp.linspace(-1.0, 1.0, 8)
    ref = reference(case, sink_logits=sinks, **opts)
    for kernel in (paged_decode_gpu, paged_decode_tpu):
        assert_close(_run(kernel, case, AttentionOptions(**opts), sinks), ref, "float32")


@pytest.mark.parametrize("ppb", [1, 3])
def test_tpu_decode_blocks_of_pages(ppb):
    """A grid step reads `ppb` pages (1: one per step; 3: blocks that end past the walk, whose
    extra slots re-name their last page and are masked) with window + sinks + soft-cap; pages
    wholly behind the window are poisoned."""
    case = make_case("int8", "float32", [13, 16, 14, 6, 0], poison_pages=[(0, 1), (1, 1), (2, 1)])
    out = _run(paged_decode_tpu, case, AttentionOptions(**OPTIONS), SINKS, pages_per_block=ppb)
    assert_close(out, reference(case, sink_logits=SINKS, **OPTIONS), "float32")


@pytest.mark.parametrize("fmt,heads,keys", [("dense", 4, 32), ("int8", 4, 32), ("int4", 4, 32), ("dense", 1, 128),
                                             ("fp8_e4m3", 1, 128)])
def test_gpu_key_tiles_fit_shared_memory(fmt, heads, keys):
    """Triton decode tiles hold <= KEY_TILE_BYTES of keys (16-bit after dequantization) across
    the program's KV heads: 128 keys x 4 heads x head_dim 128 asked an H200 for 404 KiB of
    shared memory (227 KiB there), so 32/8 heads get 32 keys and MQA keeps 128."""
    from pallas_kernels.gpu_tiles import KEY_TILE_BYTES, default_pages_per_block, key_bytes

    pages = from_layer_kv(make_case(fmt, "bfloat16", [5], heads=(8 * heads, heads), head_dim=128, page=PAGE).layer)
    per_key = key_bytes(pages, heads, 128)
    assert per_key >= heads * 2 * 128 * 2
    assert default_pages_per_block(PAGE, 64, per_key) * PAGE == keys
    assert keys * per_key <= KEY_TILE_BYTES
