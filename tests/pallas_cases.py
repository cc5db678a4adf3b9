"""Test inputs for the Pallas kernels: small paged caches in every format, poisoned with NaN
wherever no sequence may read (unowned pages, positions at or past a sequence's length, stale
KIVI pages whose tokens live in the tail, other slots' tails)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv import formats as F
from jaxinfer.kv.dense import LayerKV
from jaxinfer.kv.pages import NULL_PAGE
from jaxinfer.kv.kivi import KiviLayerKV
from jaxinfer.kv.token_quant import TokenQuantLayerKV
from jaxinfer.attention.reference import mla_attention_reference, paged_attention_reference
from jaxinfer.kv.latent import LatentKV

# Tightest tolerances the arithmetic allows (measured maxima in brackets):
#   f32 compute (dense f32 and every quantized format with f32 queries): kernels and reference
#   differ only in summation order [5e-7]          -> atol = rtol = 2e-6
#   bf16: both round probabilities and the output to bf16; they differ by at most one bf16
#   ulp of outputs up to ~3 in magnitude [2**-7]   -> atol = 2**-6, rtol = 2**-7
TOLERANCES = {"float32": dict(atol=2e-6, rtol=2e-6), "bfloat16": dict(atol=2.0**-6, rtol=2.0**-7)}

HQ, HKV, DH, PAGE, MAX_PAGES = 4, 2, 16, 4, 4


@dataclasses.dataclass
class Case:
    q: jnp.ndarray  # [B, T, Hq, Dh]
    layer: object  # LayerKV | TokenQuantLayerKV | KiviLayerKV
    block_tables: jnp.ndarray  # i32[B, MAX_PAGES]
    lengths: jnp.ndarray  # i32[B]
    query_index: jnp.ndarray  # i32[B, T]
    slots: jnp.ndarray  # i32[B]
    scale: float


def make_case(fmt: str, dtype: str, lengths, starts=None, t: int = 1, seed: int = 0, max_pages: int = MAX_PAGES,
              poison_pages=(), heads: tuple[int, int] = (HQ, HKV), head_dim: int = DH, page: int = PAGE) -> Case:
    """Sequence b holds lengths[b] tokens; its T queries sit at starts[b] + t (default: the last T).

    Shapes: `heads` = (query heads, KV heads), `head_dim`, `page` (tokens per page); the
    defaults are toy sizes, tests at production-like sizes pass e.g. head_dim=128, page=16.

    Block tables are random permutations of the pool; entries past a sequence's pages point at
    page 0 (NULL_PAGE) or at another sequence's pages. `poison_pages` lists (b, logical page)
    pairs to poison although they are owned (pages a mask must keep the kernel from reading).
    """
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    lengths = np.asarray(lengths, np.int32)
    b = len(lengths)
    num_pages = 1 + b * max_pages
    table = rng.permutation(np.arange(1, num_pages)).reshape(b, max_pages).astype(np.int32)
    owned = np.zeros((num_pages, page), bool)  # pool tokens some sequence may read
    for i, n in enumerate(lengths):
        used = -(-n // page)
        for j in range(used, max_pages):  # unused entries: NULL_PAGE or a neighbour's page
            table[i, j] = NULL_PAGE if (i + j) % 2 else table[(i + 1) % b, j]
        for pos in range(n):
            owned[table[i, pos // page], pos % page] = True
    for i, j in poison_pages:
        owned[table[i, j]] = False
    slots = rng.permutation(b).astype(np.int32)
    k = rng.normal(size=(num_pages, page, hkv, head_dim)).astype(np.float32)
    v = rng.normal(size=(num_pages, page, hkv, head_dim)).astype(np.float32)
    layer = _layer(fmt, dtype, k, v, owned, table, lengths, slots, rng)
    starts = lengths - t if starts is None else np.asarray(starts, np.int32)
    query_index = starts[:, None] + np.arange(t, dtype=np.int32)[None, :]
    q = jnp.asarray(rng.normal(size=(b, t, hq, head_dim)), dtype)
    return Case(q, layer, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(query_index), jnp.asarray(slots),
                1.0 / np.sqrt(head_dim))


def _poison(x, keep):
    """NaN wherever `keep` (broadcast over x's trailing axes) is False."""
    keep = keep.reshape(keep.shape + (1,) * (x.ndim - keep.ndim))
    return jnp.where(jnp.asarray(keep), x, jnp.nan)


def _layer(fmt, dtype, k, v, owned, table, lengths, slots, rng):
    if fmt == "dense":
        return LayerKV(k=_poison(jnp.asarray(k, dtype), owned), v=_poison(jnp.asarray(v, dtype), owned))
    if fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
        quant = F.quantize_int8 if fmt == "int8" else lambda x: F.quantize_fp8(x, F.fp8_dtype(fmt))
        (kq, ks), (vq, vs) = quant(jnp.asarray(k)), quant(jnp.asarray(v))
        return TokenQuantLayerKV(kq, vq, _poison(ks, owned), _poison(vs, owned), format=fmt, dtype=dtype)
    bits = F.get_format(fmt).bits
    page, hkv, head_dim = k.shape[1:]
    current = np.zeros_like(owned)  # a sequence's current page is read from its tail, not the pool
    tail_keep = np.zeros((len(lengths), page), bool)
    for i, n in enumerate(lengths):
        if n % page:  # the partly filled page: its tokens live in the slot's tail
            current[table[i, n // page]] = True
            tail_keep[slots[i], : n % page] = True
    pool = owned & ~current.any(axis=1, keepdims=True)
    kq, ks, kz = F.quantize_kivi_keys(jnp.asarray(k), bits)
    vq, vs, vz = F.quantize_kivi_values(jnp.asarray(v), bits)
    page_keep = pool.any(axis=1)
    tails = [jnp.asarray(rng.normal(size=(len(lengths), page, hkv, head_dim)), dtype) for _ in range(2)]
    return KiviLayerKV(kq, vq, _poison(ks, page_keep), _poison(kz, page_keep), _poison(vs, pool), _poison(vz, pool),
                       _poison(tails[0], tail_keep), _poison(tails[1], tail_keep), format=fmt)


def reference(case: Case, **options):
    """jaxinfer's reference (the engine's path) on the case, jitted (eager dispatch is slow)."""
    return _jitted_reference(case.q, case.layer, case.block_tables, case.lengths, case.query_index, case.scale,
                             slots=case.slots, **options)


_jitted_reference = jax.jit(paged_attention_reference, static_argnames=("scale", "window", "num_sinks", "soft_cap"))


def assert_close(out, ref, dtype: str):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "NaN/inf leaked into the output"
    np.testing.assert_allclose(out, ref, **TOLERANCES[dtype])


def make_mla_case(lengths, heads: int, rank: int, rope_dim: int, page: int, max_pages: int, seed: int = 0,
                  dtype: str = "float32"):
    """An MLA latent cache from make_case with one "KV head" of width r + dr, its keys split into
    c_kv [P, S, r] and k_rope [P, S, dr], and queries, all of `dtype`.

    -> (q_latent [B, H, r], q_rope [B, H, dr] of `dtype`, LatentKV, block tables, lengths, scale)."""
    case = make_case("dense", dtype, lengths, heads=(1, 1), head_dim=rank + rope_dim, page=page,
                     max_pages=max_pages, seed=seed)
    keys = case.layer.k[:, :, 0]  # [P, S, r + dr], NaN where no sequence may read
    latent = LatentKV(c_kv=keys[..., :rank], k_rope=keys[..., rank:])
    rng = np.random.default_rng(seed + 1)
    q = jnp.asarray(rng.normal(size=(len(lengths), heads, rank + rope_dim)), dtype)
    return q[..., :rank], q[..., rank:], latent, case.block_tables, case.lengths, (rank + rope_dim) ** -0.5


@jax.jit
def mla_reference(q_latent, q_rope, latent, block_tables, lengths, scale):
    """The absorbed reference at T = 1 with identity W_UK, W_UV -> f32[B, H, r]."""
    h, r = q_latent.shape[1:]
    eye = jnp.broadcast_to(jnp.eye(r, dtype=jnp.float32), (h, r, r))
    out = mla_attention_reference(q_latent[:, None], q_rope[:, None], latent, eye, eye, block_tables, lengths,
                                  (lengths - 1)[:, None], scale, absorb=True)
    return out[:, 0]
