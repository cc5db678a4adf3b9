"""The Mosaic GPU kernels (pallas_kernels/paged_attention_mgpu.py) in jax's GPU interpret mode
against jaxinfer's reference.

The kernel computes both matmuls in bf16 (f16 for fp8 pages) with f32 accumulation, so every
case is held to the bf16 tolerance of pallas_cases.TOLERANCES, f32 queries included. Inputs
are NaN wherever no sequence may read (pallas_cases): past each length, unowned pages, pages
behind a window; KIVI: a sequence's current page in the pool (its tokens are in the tail),
other slots' tails and tail positions past the length.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_cases import assert_close, make_case, reference
from pallas_kernels.common import AttentionOptions
from pallas_kernels.formats import from_layer_kv
from pallas_kernels.paged_attention_mgpu import check_mgpu_shapes, chunked_prefill_mgpu, paged_decode_mgpu, tiles_for

PAGE = 16
EDGE_LENGTHS = [0, 1, PAGE, PAGE + 1, 3 * PAGE + 5]
OPTIONS = dict(window=21, num_sinks=3, soft_cap=4.0)


def _run(case, opts=AttentionOptions(), sink_logits=None, **kw):
    out = paged_decode_mgpu(case.q[:, 0], from_layer_kv(case.layer), case.block_tables, case.lengths,
                            case.query_index[:, 0], sink_logits, case.slots, scale=case.scale, opts=opts,
                            interpret=True, **kw)
    return out[:, None]


@pytest.mark.parametrize("fmt,dtype", [
    ("dense", "bfloat16"), ("dense", "float16"), ("int8", "float32"), ("int8", "bfloat16"),
    ("fp8_e4m3", "bfloat16"), ("fp8_e5m2", "float32"), ("int4", "float32"), ("int2", "bfloat16"),
])
def test_mgpu_decode_every_format(fmt, dtype):
    """8 query / 2 KV heads, head_dim 64, pages of 16: two pages per 64-key tile (KIVI with f32
    queries: f32 tails too, converted to bf16 per call)."""
    case = make_case(fmt, dtype, EDGE_LENGTHS, heads=(8, 2), head_dim=64, page=PAGE)
    assert_close(_run(case), reference(case), "bfloat16")


@pytest.mark.parametrize("fmt", ["dense", "int8"])
def test_mgpu_decode_window_sinks_softcap_split_k(fmt):
    """Window + sink tokens + soft cap + sink logits over 3 splits; pages wholly behind the
    window are poisoned (never read)."""
    case = make_case(fmt, "bfloat16", [60, 64, 37, 23], heads=(8, 2), head_dim=64, page=PAGE,
                     poison_pages=[(0, 1), (1, 1)])
    sinks = jnp.linspace(-2.0, 1.5, 8)
    out = _run(case, AttentionOptions(**OPTIONS), sinks, k_splits=3)
    assert_close(out, reference(case, sink_logits=sinks, **OPTIONS), "bfloat16")


@pytest.mark.parametrize("heads,page,fmt", [((32, 8), 16, "int8"), ((16, 8), 64, "dense")])
def test_mgpu_decode_production_shapes(heads, page, fmt):
    """head_dim 128: a 128-key page per tile (32/8 heads, page 16), and a page of 512 keys
    (8 heads x 64 tokens) read in four chunks."""
    case = make_case(fmt, "bfloat16", [0, 1, page + 3, 2 * page], heads=heads, head_dim=128, page=page, max_pages=3)
    assert_close(_run(case), reference(case), "bfloat16")


def test_tiles():
    """Keys per tile: two 32-key pages; one 128-key page; a 512-key page in chunks of 128 (256
    would need 256 KiB of double-buffered bf16 stages), of 64 at head_dim 256; 128 query rows
    (two row blocks)."""
    def tiles(fmt, heads, page, dh=128):
        rows = 64 * -(-heads[0] // 64)
        return tiles_for(from_layer_kv(make_case(fmt, "bfloat16", [1], heads=heads, head_dim=dh, page=page).layer),
                         rows)
    assert tiles("int8", (8, 2), 16) == (2, 1)
    assert tiles("dense", (32, 8), 16) == (1, 1)
    assert tiles("dense", (16, 8), 64) == (1, 4)
    assert tiles("dense", (128, 8), 16) == (1, 1)
    assert tiles("dense", (16, 8), 64, dh=256) == (1, 8)


def test_mgpu_refuses_what_it_cannot_read():
    """f32 pages, head_dim not a multiple of 64, or scales under one TMA unit (int8, KIVI's
    per-token value scales: MQA pages of 16): a ValueError naming the reason (the dispatch then
    runs the Triton kernel)."""
    for fmt, dtype, heads, dh, match in [("dense", "float32", (8, 2), 64, "bf16/f16"),
                                         ("dense", "bfloat16", (8, 2), 16, "multiple of 64"),
                                         ("int4", "bfloat16", (8, 2), 32, "multiple of 64"),
                                         ("int8", "float32", (8, 1), 64, "multiple of 32"),
                                         ("int2", "bfloat16", (8, 1), 64, "multiple of 32")]:
        case = make_case(fmt, dtype, [5], heads=heads, head_dim=dh, page=PAGE)
        with pytest.raises(ValueError, match=match):
            check_mgpu_shapes(from_layer_kv(case.layer), 64)


def _prefill(case, opts=AttentionOptions(), sink_logits=None):
    return chunked_prefill_mgpu(case.q, from_layer_kv(case.layer), case.block_tables, case.lengths, case.query_index,
                                sink_logits, case.slots, scale=case.scale, opts=opts, interpret=True)


@pytest.mark.parametrize("fmt,dtype", [("dense", "bfloat16"), ("int8", "float32"), ("fp8_e4m3", "bfloat16")])
def test_mgpu_prefill_edge_lengths(fmt, dtype):
    """A chunk of 3 queries per sequence, causal inside the chunk, over cached prefixes ending at
    0 (idle row), 1 (a chunk padded past its one real token), a page multiple, and more."""
    case = make_case(fmt, dtype, [0, 1, PAGE, 3 * PAGE + 5], [0, 0, PAGE - 3, 2 * PAGE], t=3, heads=(8, 2),
                     head_dim=64, page=PAGE)
    assert_close(_prefill(case), reference(case), "bfloat16")


@pytest.mark.parametrize("fmt", ["dense", "int8"])
def test_mgpu_prefill_query_blocks_window_sinks_softcap(fmt):
    """32 query / 8 KV heads, 5 queries: dense pages go to per-head programs (4 query heads x 16
    queries in 64 rows), int8 pages to all-heads programs (32 heads x 2 queries: 3 blocks, each
    walking only the pages its own queries see); pages behind every window are poisoned."""
    case = make_case(fmt, "bfloat16", [60, 64, 37, 23], t=5, heads=(32, 8), head_dim=64, page=PAGE,
                     poison_pages=[(0, 1), (1, 1)])
    sinks = jnp.linspace(-2.0, 1.5, 32)
    out = _prefill(case, AttentionOptions(**OPTIONS), sinks)
    assert_close(out, reference(case, sink_logits=sinks, **OPTIONS), "bfloat16")


@pytest.mark.parametrize("heads,page,fmt", [((32, 8), 16, "dense"), ((8, 1), 64, "dense"), ((32, 8), 16, "fp8_e5m2")])
def test_mgpu_prefill_production_shapes(heads, page, fmt):
    """head_dim 128, a chunk of 7 queries: per-head programs over pages of 16 (4 to a tile) and
    MQA pages of 64; all-heads programs over fp8 pages."""
    case = make_case(fmt, "bfloat16", [7, page + 3, 2 * page + 7], t=7, heads=heads, head_dim=128, page=page,
                     max_pages=3)
    assert_close(_prefill(case), reference(case), "bfloat16")


# KIVI (int4 / int2): keys per channel per page, values per token, the current page in the slot's tail

KIVI_SHAPES = [((8, 2), 64, PAGE), ((32, 8), 128, PAGE), ((8, 1), 64, 2 * PAGE), ((8, 1), 128, 2 * PAGE)]


def _kivi_id(shape) -> str:
    (hq, hkv), dh, page = shape
    return f"h{hq}/{hkv}-d{dh}-page{page}"


@pytest.mark.parametrize("shape", KIVI_SHAPES, ids=_kivi_id)
@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_mgpu_kivi_decode_edge_lengths(fmt, shape):
    """GQA at head_dim 64 / 128 with pages of 16 (two pages to a 64-key tile; one 128-key page),
    MQA with pages of 32 (MQA pages of 16 are refused: under one TMA unit of value scales).
    Lengths 0 (idle row), 1 (the tail alone), a page (no tail), page + 1 and long: the current
    page is read from the row's tail (its slot is not its row), never from the pool."""
    heads, dh, page = shape
    case = make_case(fmt, "bfloat16", [0, 1, page, page + 1, 3 * page + 5], heads=heads, head_dim=dh, page=page)
    assert_close(_run(case), reference(case), "bfloat16")


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_mgpu_kivi_decode_window_sinks_softcap_split_k(fmt):
    """Window + sink tokens + soft cap + sink logits over 3 splits (the tail is folded in by the
    split owning the last schedule step); pages wholly behind the window are poisoned."""
    case = make_case(fmt, "bfloat16", [60, 64, 37, 23], heads=(8, 2), head_dim=64, page=PAGE,
                     poison_pages=[(0, 1), (1, 1)])
    sinks = jnp.linspace(-2.0, 1.5, 8)
    out = _run(case, AttentionOptions(**OPTIONS), sinks, k_splits=3)
    assert_close(out, reference(case, sink_logits=sinks, **OPTIONS), "bfloat16")


def test_mgpu_kivi_decode_page_in_chunks():
    """A 512-key int4 page (8 KV heads x 64 tokens, head_dim 128) read in four chunks: the tail
    too, chunk by chunk; a partly filled current page with 3 and 63 tokens."""
    case = make_case("int4", "bfloat16", [0, 3, 64, 64 + 63], heads=(16, 8), head_dim=128, page=64, max_pages=3)
    assert tiles_for(from_layer_kv(case.layer), 64) == (1, 4)
    assert_close(_run(case), reference(case), "bfloat16")


@pytest.mark.parametrize("shape", [((8, 2), 64, PAGE), ((32, 8), 128, PAGE), ((8, 1), 64, 2 * PAGE)], ids=_kivi_id)
@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_mgpu_kivi_prefill_edge_lengths(fmt, shape):
    """A chunk of 3 queries per sequence, causal inside the chunk, over cached prefixes ending at
    0, 1, a page multiple, page + 1 and more; all-heads programs (KIVI key scales are a row
    block per page)."""
    heads, dh, page = shape
    case = make_case(fmt, "bfloat16", [0, 1, page, page + 1, 3 * page + 5], [0, 0, page - 3, page - 2, 2 * page],
                     t=3, heads=heads, head_dim=dh, page=page)
    assert_close(_prefill(case), reference(case), "bfloat16")


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_mgpu_kivi_prefill_window_sinks_softcap(fmt):
    """32 query / 8 KV heads, 5 queries (2 to a 64-row block: 3 blocks), window + sinks + soft cap +
    sink logits; pages behind every window poisoned."""
    case = make_case(fmt, "bfloat16", [60, 64, 37, 23], t=5, heads=(32, 8), head_dim=64, page=PAGE,
                     poison_pages=[(0, 1), (1, 1)])
    sinks = jnp.linspace(-2.0, 1.5, 32)
    out = _prefill(case, AttentionOptions(**OPTIONS), sinks)
    assert_close(out, reference(case, sink_logits=sinks, **OPTIONS), "bfloat16")
