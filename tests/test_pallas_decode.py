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
