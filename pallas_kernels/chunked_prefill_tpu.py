"""Chunked-prefill attention over paged KV for TPU, any page format: one Pallas kernel.

Lowering: Pallas **Mosaic TPU** with `pltpu.PrefetchScalarGridSpec` (lengths, slots, each
query block's [min, max] query position and the flattened block tables in SMEM drive the
page index maps; tpu_tiles.py draws the walk). Verified in interpret mode only.

Reference: `jaxinfer.attention.reference.paged_attention_reference`.

Shapes::

    q             [B, T, Hq, Dh]
    pages         KernelPages            k, v [P, S, Hkv, Dh] (+ scales, KIVI tails)
    block_tables  i32[B, max_pages]
    lengths       i32[B]                 keys cached per sequence, this chunk's included
    query_pos     i32[B, T]              cache position of each query (causal limit)
    sink_logits   f32[Hq] | None
    slots         i32[B] | None          cache slot of each row (KIVI tails)
    ->            [B, T, Hq, Dh]         q.dtype

Grid (B, T_pad / block_q, cdiv(max_pages, ppb)). A query block is `block_q` queries times every query
head, laid out per KV head as rows r = t * G + g (common.prefill_rows);
each step reads up to ppb pages (all KV heads) that some query of the block can see, the
next step's pages in flight meanwhile (tpu_tiles.py); causality
inside the chunk is the per-row mask `key <= query_pos`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_tiles
from pallas_kernels.formats import KernelPages
from pallas_kernels.common import (MASK_VALUE, AttentionOptions, cdiv, check_prefill_shapes, check_sink_logits,
                                   finalize, prefill_rows)


def _kernel(lengths_ref, slots_ref, q_lo_ref, q_hi_ref, bt_ref, row_pos_ref, q_ref, *refs,
            cfg: tpu_tiles.TpuConfig, has_sinks: bool, num_blocks: int):
    slot_refs, tail_refs, rest = tpu_tiles.split_refs(refs, cfg)
    sink_ref, o_ref, m_sc, l_sc, acc_sc = rest if has_sinks else (None, *rest)
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, q_lo, q_hi = lengths_ref[b], q_lo_ref[b * num_blocks + j], q_hi_ref[b * num_blocks + j]
    walk = tpu_tiles.Walk(length, q_lo, q_hi, cfg)
    row_pos = row_pos_ref[...]  # [rows, 1]

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def attend(slot_refs, layouts, fmt, slot_pages):
        for h in range(cfg.num_kv_heads):
            carry = tpu_tiles.read_carry(m_sc, l_sc, acc_sc, (h,), cfg.parts)
            q = tpu_tiles.q_parts(q_ref[h], cfg.parts)
            carry = tpu_tiles.attend_head(carry, q, h, slot_refs, layouts, fmt, slot_pages, length, q_lo, q_hi,
                                          row_pos, cfg)
            tpu_tiles.write_carry(m_sc, l_sc, acc_sc, (h,), carry)

    @pl.when(i * cfg.pages_per_block < walk.pool_steps)
    def _pool_pages():
        attend(slot_refs, (cfg.k_layouts, cfg.v_layouts), cfg.fmt, tpu_tiles.block_keys(walk, i, cfg))

    if cfg.has_tail:
        @pl.when(walk.use_tail & (i == walk.pool_steps // cfg.pages_per_block))
        def _tail_page():
            attend(((tail_refs[:1], tail_refs[1:]),), (("token",), ("token",)), "dense",
                   [(length // cfg.page_size, True)])

    @pl.when(i == pl.num_programs(2) - 1)
    def _output():
        sink = sink_ref[...] if has_sinks else None
        o_ref[...] = finalize(m_sc[...], l_sc[...], acc_sc[...], sink).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "opts", "block_q", "pages_per_block", "interpret"))
def chunked_prefill_tpu(
    q: jax.Array,
    pages: KernelPages,
    block_tables: jax.Array,
    lengths: jax.Array,
    query_pos: jax.Array,
    sink_logits: jax.Array | None = None,
    slots: jax.Array | None = None,
    *,
    scale: float,
    opts: AttentionOptions = AttentionOptions(),
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention of a chunk of queries through block tables -> [B, T, Hq, Dh] (module docstring)."""
    b, t, hq, dh = q.shape
    slots = pages.row_slots(slots, b)
    pages.validate()
    check_prefill_shapes(q, pages, block_tables, lengths, query_pos)
    check_sink_logits(sink_logits, hq)
    hkv, max_pages = pages.num_kv_heads, block_tables.shape[1]
    group = hq // hkv
    g_pad = group  # TPU needs no power-of-two rows
    bq = block_q or min(t, max(8, 128 // g_pad // 8 * 8))  # rows of a partial block: a multiple of 8 (Mosaic)
    t_pad = cdiv(t, bq) * bq
    rows, num_blocks = bq * g_pad, t_pad // bq
    cfg = tpu_tiles.TpuConfig.of(pages, max_pages=max_pages, opts=opts, scale=scale, pages_per_block=pages_per_block)
    q_rows, row_pos, q_lo, q_hi = prefill_rows(q, query_pos, hkv, g_pad, t_pad, bq)

    def page_of(slot, b_, j, i, lengths_ref, slots_ref, q_lo_ref, q_hi_ref, bt_ref):
        k = b_ * num_blocks + j
        walk = tpu_tiles.Walk(lengths_ref[b_], q_lo_ref[k], q_hi_ref[k], cfg)
        return walk.physical_page(bt_ref, b_, i, slot, cfg)

    def slot_of(b_, j, i, lengths_ref, slots_ref, *_):
        return slots_ref[b_]

    sink_args, sink_specs = (), []
    if sink_logits is not None:
        sink = jnp.tile(sink_logits.astype(jnp.float32).reshape(hkv, group), (1, bq))  # row r: head r % G
        sink_args = (sink[..., None],)
        sink_specs = [pl.BlockSpec((hkv, rows, 1), lambda *_: (0, 0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(b, num_blocks, cfg.num_blocks),
        in_specs=[
            pl.BlockSpec((None, rows, 1), lambda b_, j, i, *_: (b_, j, 0)),
            pl.BlockSpec((None, hkv, rows, dh), lambda b_, j, i, *_: (b_, 0, j, 0)),
            *tpu_tiles.page_specs(pages, page_of, slot_of, cfg.pages_per_block),
            *sink_specs,
        ],
        out_specs=pl.BlockSpec((None, hkv, rows, dh), lambda b_, j, i, *_: (b_, 0, j, 0)),
        scratch_shapes=[pltpu.VMEM((hkv, rows, 1), jnp.float32), pltpu.VMEM((hkv, rows, 1), jnp.float32),
                        pltpu.VMEM((hkv, rows, dh), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, has_sinks=sink_logits is not None, num_blocks=num_blocks),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="chunked_prefill_tpu",
    )(lengths.astype(jnp.int32), slots.astype(jnp.int32), q_lo.reshape(-1), q_hi.reshape(-1),
      block_tables.astype(jnp.int32).reshape(-1), row_pos[..., None], q_rows,
      *tpu_tiles.page_operands(pages, cfg.pages_per_block),
      *sink_args)
    out = out.reshape(b, hkv, t_pad, g_pad, dh)[:, :, :t, :group]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dh)
