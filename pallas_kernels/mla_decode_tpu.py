"""MLA latent decode attention for TPU: absorbed queries against the paged latent cache, one Pallas kernel.

Lowering: Pallas **Mosaic TPU**, with `pltpu.PrefetchScalarGridSpec` (lengths and the flattened
block tables in SMEM drive the page index maps), the page walk of tpu_tiles.py. Verified in
interpret mode only (no TPU was lent to this project yet).

Reference: `jaxinfer.attention.reference.mla_attention_reference(absorb=True)` with T = 1,
before its W_UV step (the caller applies W_UV to the latent output).

MLA absorbed into latent space is an MQA with one "KV head" whose key is [c ; k_rope] and
whose value is c: every query head reads the same latent page, so a page is fetched once for
all H heads and a step's pages make one [H, ppb * S] score tile::

    score[h, j] = scale * (q_latent[h] . c[j] + q_rope[h] . k_rope[j])   (two dots, summed)
    out[h]      = sum_j softmax_j(score[h]) c[j]                          (online softmax)

Shapes::

    q_latent      [B, H, r]              W_UK[h]^T q_nope[h] (kv_lora_rank r)
    q_rope        [B, H, dr]             rotated
    c_kv          [P, S, r]              the latent cache pool (`LatentKV.c_kv`)
    k_rope        [P, S, dr]             the shared RoPE keys (`LatentKV.k_rope`)
    block_tables  i32[B, max_pages]
    lengths       i32[B]                 keys cached per sequence (this step's included)
    ->            f32[B, H, r]           attention output in latent space

Grid (B, cdiv(max_pages, ppb)): sequence b, grid step i ("arbitrary": the carry lives in VMEM
scratch). Each step reads up to ppb latent pages (default about 128 keys) with the next
step's in flight; past the sequence's length nothing is fetched or computed (tpu_tiles.Walk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_tiles
from pallas_kernels.common import (MASK_VALUE, AttentionOptions, Carry, attend_tile, check_mla_shapes, finalize,
                                   visible)


def _kernel(lengths_ref, bt_ref, q_latent_ref, q_rope_ref, *refs, cfg: tpu_tiles.TpuConfig):
    page_refs, (o_ref, m_sc, l_sc, acc_sc) = refs[:-4], refs[-4:]
    c_refs, rope_refs = page_refs[0::2], page_refs[1::2]  # per page slot
    b, i = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]
    walk = tpu_tiles.Walk(length, length - 1, length - 1, cfg)

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(i * cfg.pages_per_block < walk.pool_steps)
    def _pages():
        slot_pages = tpu_tiles.block_keys(walk, i, cfg)
        key_ok = visible(tpu_tiles.key_positions(slot_pages, cfg.page_size, axis=0), length - 1, length, cfg.opts)
        vis = visible(tpu_tiles.key_positions(slot_pages, cfg.page_size, axis=1), length - 1, length, cfg.opts)
        c = jnp.concatenate([ref[...] for ref in c_refs], axis=0)  # [ppb * S, r]
        k_rope = jnp.concatenate([ref[...] for ref in rope_refs], axis=0)  # [ppb * S, dr]
        carry = Carry(m_sc[...], l_sc[...], (acc_sc[...],))
        carry = attend_tile(carry, (q_latent_ref[...], q_rope_ref[...]), (c, k_rope), (c,), vis, key_ok,
                            scale=cfg.scale, soft_cap=None)
        m_sc[...], l_sc[...], acc_sc[...] = carry.m, carry.l, carry.acc[0]

    @pl.when(i == pl.num_programs(1) - 1)
    def _output():
        o_ref[...] = finalize(m_sc[...], l_sc[...], acc_sc[...])


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "interpret"))
def mla_decode_tpu(
    q_latent: jax.Array,
    q_rope: jax.Array,
    c_kv: jax.Array,
    k_rope: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    pages_per_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed MLA decode through block tables -> f32[B, H, r] (see the module docstring)."""
    check_mla_shapes(q_latent, q_rope, c_kv, k_rope, block_tables, lengths)
    b, h, r = q_latent.shape
    dr, page_size, max_pages = q_rope.shape[-1], c_kv.shape[1], block_tables.shape[1]
    ppb = pages_per_block or tpu_tiles.default_pages_per_block(page_size, max_pages)
    cfg = tpu_tiles.TpuConfig(fmt="dense", k_layouts=(), v_layouts=(), parts=1, page_size=page_size,
                              num_kv_heads=1, max_pages=max_pages, pages_per_block=ppb, has_tail=False,
                              opts=AttentionOptions(), scale=scale, steps=max_pages)

    def page_spec(slot: int, width: int) -> pl.BlockSpec:
        def index_map(b_, i, lengths_ref, bt_ref):
            walk = tpu_tiles.Walk(lengths_ref[b_], lengths_ref[b_] - 1, lengths_ref[b_] - 1, cfg)
            return walk.physical_page(bt_ref, b_, i, slot, cfg), 0, 0
        return pl.BlockSpec((None, page_size, width), index_map)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, cfg.num_blocks),
        in_specs=[
            pl.BlockSpec((None, h, r), lambda b_, i, *_: (b_, 0, 0)),
            pl.BlockSpec((None, h, dr), lambda b_, i, *_: (b_, 0, 0)),
            *[spec for slot in range(ppb) for spec in (page_spec(slot, r), page_spec(slot, dr))],
        ],
        out_specs=pl.BlockSpec((None, h, r), lambda b_, i, *_: (b_, 0, 0)),
        scratch_shapes=[pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                        pltpu.VMEM((h, r), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, cfg=cfg),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, h, r), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="mla_decode_tpu",
    )(lengths.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), q_latent, q_rope,
      *(c_kv, k_rope) * ppb)
