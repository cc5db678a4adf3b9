"""MLA latent decode kernels (GPU-style and TPU-style) in interpret mode against jaxinfer's reference.

pallas_cases.make_mla_case: make_case's permuted block tables and its NaN in every token no
sequence may read (pages of no sequence, positions at or past a length); the reference is
`mla_attention_reference` (absorbed) with W_UK = W_UV = identity (pallas_cases.mla_reference),
whose output is then the kernels' latent output.
"""

from __future__ import annotations

import numpy as np
import pytest

from pallas_cases import make_mla_case, mla_reference
from pallas_kernels.mla_decode_gpu import mla_decode_gpu
from pallas_kernels.mla_decode_tpu import mla_decode_tpu

# f32: kernels and reference differ in summation order (two dots vs one over [c ; k_rope]) only.
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
TOY = dict(heads=4, rank=16, rope_dim=8, page=4, max_pages=4)
DEEPSEEK = dict(heads=16, rank=512, rope_dim=64, page=16, max_pages=3)  # DeepSeek-V3's r, dr; 16 heads per device


def _check(kernel, lengths, shape, **kw):
    q_latent, q_rope, latent, block_tables, lengths, scale = make_mla_case(lengths, **shape)
    out = kernel(q_latent, q_rope, latent.c_kv, latent.k_rope, block_tables, lengths, scale=scale, interpret=True,
                 **kw)
    assert np.isfinite(np.asarray(out)).all(), "NaN leaked from a page the sequence does not own"
    want = mla_reference(q_latent, q_rope, latent, block_tables, lengths, scale)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOLERANCE)


# Lengths 1, a page, a page + 1, every page (full), at toy and DeepSeek-like sizes.
@pytest.mark.parametrize("kernel", [mla_decode_gpu, mla_decode_tpu])
@pytest.mark.parametrize("shape,lengths", [(TOY, [1, 4, 5, 16]), (DEEPSEEK, [1, 16, 17, 48])])
def test_mla_decode_edge_lengths(kernel, shape, lengths):
    _check(kernel, lengths, shape)


def test_mla_decode_blocks_and_splits():
    """TPU blocks of 3 pages (the last ends past the walk: re-named slots, masked); GPU split-K
    over 3 splits of 1-page blocks (the merge of partial softmaxes), and 80 heads: two blocks
    of 64 rows, the second half padding."""
    _check(mla_decode_tpu, [13, 2, 9], TOY, pages_per_block=3)
    _check(mla_decode_gpu, [13, 2, 9], TOY, pages_per_block=1, k_splits=3)
    _check(mla_decode_gpu, [13, 2, 9], {**TOY, "heads": 80})
