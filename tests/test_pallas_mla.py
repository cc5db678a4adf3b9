"""MLA latent decode kernels (GPU-style and TPU-style) in interpret mode against jaxinfer's reference.

The latent cache comes from pallas_cases.make_case with one "KV head" of width r + dr: its
keys split into the latent c_kv [P, S, r] and the RoPE key [P, S, dr], so the cases carry
make_case's permuted block tables and its NaN in every token no sequence may read (pages of
no sequence, positions at or past a length). The reference is `mla_attention_reference`
(absorbed) with W_UK = W_UV = identity, which makes its output the kernels' latent output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_cases import make_case
from jaxinfer.attention.reference import mla_attention_reference
from jaxinfer.kv.latent import LatentKV
from pallas_kernels.mla_decode_gpu import mla_decode_gpu
from pallas_kernels.mla_decode_tpu import mla_decode_tpu

# f32: kernels and reference differ in summation order (two dots vs one over [c ; k_rope]) only.
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
TOY = dict(heads=4, rank=16, rope_dim=8, page=4, max_pages=4)
DEEPSEEK = dict(heads=16, rank=512, rope_dim=64, page=16, max_pages=3)  # DeepSeek-V3's r, dr; 16 heads per device


def _case(lengths, heads: int, rank: int, rope_dim: int, page: int, max_pages: int, seed: int = 0):
    """-> (q_latent f32[B, H, r], q_rope f32[B, H, dr], LatentKV, block tables, lengths, scale)."""
    case = make_case("dense", "float32", lengths, heads=(1, 1), head_dim=rank + rope_dim, page=page,
                     max_pages=max_pages, seed=seed)
    keys = case.layer.k[:, :, 0]  # [P, S, r + dr], NaN where no sequence may read
    latent = LatentKV(c_kv=keys[..., :rank], k_rope=keys[..., rank:])
    rng = np.random.default_rng(seed + 1)
    q = jnp.asarray(rng.normal(size=(len(lengths), heads, rank + rope_dim)), jnp.float32)
    return q[..., :rank], q[..., rank:], latent, case.block_tables, case.lengths, (rank + rope_dim) ** -0.5


@jax.jit
def _reference(q_latent, q_rope, latent, block_tables, lengths, scale):
    """The absorbed reference at T = 1 with identity W_UK, W_UV -> f32[B, H, r]."""
    h, r = q_latent.shape[1:]
    eye = jnp.broadcast_to(jnp.eye(r, dtype=jnp.float32), (h, r, r))
    out = mla_attention_reference(q_latent[:, None], q_rope[:, None], latent, eye, eye, block_tables, lengths,
                                  (lengths - 1)[:, None], scale, absorb=True)
    return out[:, 0]


def _check(kernel, lengths, shape, **kw):
    q_latent, q_rope, latent, block_tables, lengths, scale = _case(lengths, **shape)
    out = kernel(q_latent, q_rope, latent.c_kv, latent.k_rope, block_tables, lengths, scale=scale, interpret=True,
                 **kw)
    assert np.isfinite(np.asarray(out)).all(), "NaN leaked from a page the sequence does not own"
    want = _reference(q_latent, q_rope, latent, block_tables, lengths, scale)
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
