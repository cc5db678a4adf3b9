"""Chunked-prefill kernels (GPU-style and TPU-style) in interpret mode against jaxinfer's reference.

A chunk of T = 3 queries per sequence, causal inside the chunk, over cached prefixes: rows end
at lengths 0 (an idle row: queries past an empty cache see nothing), 1 (a chunk padded past
its one real token), a page multiple and a page multiple plus one. NaN in everything no
sequence may read (pallas_cases); tolerances per dtype in pallas_cases.TOLERANCES.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_cases import PAGE, assert_close, make_case, reference
from pallas_kernels.chunked_prefill_gpu import chunked_prefill_gpu
from pallas_kernels.chunked_prefill_tpu import chunked_prefill_tpu
from pallas_kernels.common import AttentionOptions
from pallas_kernels.formats import from_layer_kv

LENGTHS, STARTS = [0, 1, PAGE, PAGE + 1], [0, 0, PAGE - 3, PAGE - 1]  # query positions start + 0, 1, 2
OPTIONS = dict(window=3, num_sinks=2, soft_cap=4.0)
SINKS = jnp.array([0.3, -2.0, 1.5, 0.0])


def _run(kernel, case, opts=AttentionOptions(), sink_logits=None, **kw):
    return kernel(case.q, from_layer_kv(case.layer), case.block_tables, case.lengths, case.query_index,
                  sink_logits, case.slots, scale=case.scale, opts=opts, interpret=True, **kw)


@pytest.mark.parametrize("fmt,dtype", [("dense", "float32"), ("dense", "bfloat16"), ("int8", "float32"),
                                       ("int4", "float32")])
def test_gpu_prefill_edge_lengths(fmt, dtype):
    case = make_case(fmt, dtype, LENGTHS, STARTS, t=3)
    assert_close(_run(chunked_prefill_gpu, case), reference(case), dtype)


@pytest.mark.parametrize("fmt", ["dense", "int4"])
def test_gpu_prefill_window_sinks_softcap_query_blocks(fmt):
    """Chunks of 4 queries in blocks of 2 (each block walks only its own pages); pages wholly
    behind every query's window are poisoned."""
    case = make_case(fmt, "float32", [14, 16], t=4, poison_pages=[(0, 1), (1, 1)])
    out = _run(chunked_prefill_gpu, case, AttentionOptions(**OPTIONS), SINKS, block_q=2, pages_per_block=1)
    assert_close(out, reference(case, sink_logits=SINKS, **OPTIONS), "float32")


def test_tpu_prefill_edge_lengths():
    case = make_case("dense", "float32", LENGTHS, STARTS, t=3)
    assert_close(_run(chunked_prefill_tpu, case), reference(case), "float32")


def test_tpu_prefill_kivi_window_sinks_softcap():
    case = make_case("int4", "float32", [14, 16], t=4, poison_pages=[(0, 1), (1, 1)])
    out = _run(chunked_prefill_tpu, case, AttentionOptions(**OPTIONS), SINKS, block_q=2)
    assert_close(out, reference(case, sink_logits=SINKS, **OPTIONS), "float32")


# Production-like sizes: head_dim 128, page 16; a chunk of 5 queries ending at lengths 5, 17, 40.
PROD = dict(head_dim=128, page=16, max_pages=3)


@pytest.mark.parametrize("kernel,fmt,dtype,heads", [
    (chunked_prefill_gpu, "dense", "bfloat16", (32, 8)), (chunked_prefill_gpu, "int4", "float32", (8, 1)),
    (chunked_prefill_gpu, "fp8_e5m2", "float32", (32, 8)), (chunked_prefill_tpu, "int8", "float32", (32, 8)),
    (chunked_prefill_tpu, "int2", "float32", (8, 1)),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_prefill_production_shapes(kernel, fmt, dtype, heads):
    case = make_case(fmt, dtype, [5, 17, 40], t=5, heads=heads, **PROD)
    assert_close(_run(kernel, case), reference(case), dtype)


@pytest.mark.parametrize("ppb", [1, 3])
def test_tpu_prefill_blocks_of_pages(ppb):
    """Blocks of `ppb` pages per grid step over chunks crossing pages (KIVI: the tail page too)."""
    case = make_case("int4", "float32", LENGTHS, STARTS, t=3)
    assert_close(_run(chunked_prefill_tpu, case, pages_per_block=ppb), reference(case), "float32")
