"""Paged decode attention for TPU, any page format (dense, int8, fp8, int4, int2): one Pallas kernel.

Lowering: Pallas **Mosaic TPU**, with `pltpu.PrefetchScalarGridSpec`: lengths, query positions,
slots and the (flattened) block tables are scalar-prefetched into SMEM and drive the page
index maps (tpu_tiles.py draws the walk). Verified in interpret mode only (no TPU was lent to
this project yet).

Reference: `jaxinfer.attention.reference.paged_attention_reference` with T = 1.

Shapes::

    q             [B, Hq, Dh]
    pages         KernelPages            k, v [P, S, Hkv, Dh] (+ scales, KIVI tails)
    block_tables  i32[B, max_pages]
    lengths       i32[B]
    query_pos     i32[B]                 cache position of each query (default lengths - 1)
    sink_logits   f32[Hq] | None
    slots         i32[B] | None          cache slot of each row (KIVI tails)
    ->            [B, Hq, Dh]            q.dtype

Grid (B, cdiv(steps, ppb)), steps = max_pages or, with a window, `common.decode_steps`:
sequence b, grid step i ("arbitrary": the carry lives in VMEM scratch across steps). Each
step reads up to ppb pages (`pages_per_block`, default about 128 keys), each holding all KV
heads, the next step's pages in flight meanwhile; past the sequence's walk nothing is fetched
or computed (tpu_tiles.py). The G query heads of KV head h are rows [h*G, (h+1)*G) of q: each
page is read once for the whole group, and a step's pages make one [G, ppb * S] score tile per
head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_tiles
from pallas_kernels.common import (MASK_VALUE, AttentionOptions, check_decode_shapes, check_sink_logits, decode_steps,
                                   finalize)
from pallas_kernels.formats import KernelPages


def _kernel(lengths_ref, query_pos_ref, slots_ref, bt_ref, q_ref, *refs, cfg: tpu_tiles.TpuConfig,
            has_sinks: bool):
    slot_refs, tail_refs, rest = tpu_tiles.split_refs(refs, cfg)
    sink_ref, o_ref, m_sc, l_sc, acc_sc = rest if has_sinks else (None, *rest)
    b, i = pl.program_id(0), pl.program_id(1)
    length, query_pos = lengths_ref[b], query_pos_ref[b]
    walk = tpu_tiles.Walk(length, query_pos, query_pos, cfg)
    group = q_ref.shape[0] // cfg.num_kv_heads

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def attend(slot_refs, layouts, fmt, slot_pages):
        for h in range(cfg.num_kv_heads):
            rows = (pl.ds(h * group, group), slice(None))
            carry = tpu_tiles.read_carry(m_sc, l_sc, acc_sc, rows, cfg.parts)
            q = tpu_tiles.q_parts(q_ref[rows], cfg.parts)
            carry = tpu_tiles.attend_head(carry, q, h, slot_refs, layouts, fmt, slot_pages, length, query_pos,
                                          query_pos, None, cfg)
            tpu_tiles.write_carry(m_sc, l_sc, acc_sc, rows, carry)

    @pl.when(i * cfg.pages_per_block < walk.pool_steps)
    def _pool_pages():
        attend(slot_refs, (cfg.k_layouts, cfg.v_layouts), cfg.fmt, tpu_tiles.block_keys(walk, i, cfg))

    if cfg.has_tail:
        @pl.when(walk.use_tail & (i == walk.pool_steps // cfg.pages_per_block))
        def _tail_page():
            attend(((tail_refs[:1], tail_refs[1:]),), (("token",), ("token",)), "dense",
                   [(length // cfg.page_size, True)])

    @pl.when(i == pl.num_programs(1) - 1)
    def _output():
        sink = sink_ref[...] if has_sinks else None
        o_ref[...] = finalize(m_sc[...], l_sc[...], acc_sc[...], sink).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "opts", "pages_per_block", "interpret"))
def paged_decode_tpu(
    q: jax.Array,
    pages: KernelPages,
    block_tables: jax.Array,
    lengths: jax.Array,
    query_pos: jax.Array | None = None,
    sink_logits: jax.Array | None = None,
    slots: jax.Array | None = None,
    *,
    scale: float,
    opts: AttentionOptions = AttentionOptions(),
    pages_per_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention through block tables -> [B, Hq, Dh] (see the module docstring)."""
    b, hq, dh = q.shape
    query_pos = lengths - 1 if query_pos is None else query_pos
    slots = pages.row_slots(slots, b)
    pages.validate()
    check_decode_shapes(q, pages, block_tables, lengths, query_pos)
    check_sink_logits(sink_logits, hq)
    max_pages = block_tables.shape[1]
    cfg = tpu_tiles.TpuConfig.of(pages, max_pages=max_pages, opts=opts, scale=scale, pages_per_block=pages_per_block,
                                 steps=decode_steps(max_pages, pages.page_size, opts))

    def page_of(slot, b_, i, lengths_ref, query_pos_ref, slots_ref, bt_ref):
        walk = tpu_tiles.Walk(lengths_ref[b_], query_pos_ref[b_], query_pos_ref[b_], cfg)
        return walk.physical_page(bt_ref, b_, i, slot, cfg)

    def slot_of(b_, i, lengths_ref, query_pos_ref, slots_ref, bt_ref):
        return slots_ref[b_]

    sink_args, sink_specs = (), []
    if sink_logits is not None:
        sink_args = (sink_logits.astype(jnp.float32).reshape(hq, 1),)
        sink_specs = [pl.BlockSpec((hq, 1), lambda *_: (0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(b, cfg.num_blocks),
        in_specs=[
            pl.BlockSpec((None, hq, dh), lambda b_, i, *_: (b_, 0, 0)),
            *tpu_tiles.page_specs(pages, page_of, slot_of, cfg.pages_per_block),
            *sink_specs,
        ],
        out_specs=pl.BlockSpec((None, hq, dh), lambda b_, i, *_: (b_, 0, 0)),
        scratch_shapes=[pltpu.VMEM((hq, 1), jnp.float32), pltpu.VMEM((hq, 1), jnp.float32),
                        pltpu.VMEM((hq, dh), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, has_sinks=sink_logits is not None),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, hq, dh), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="paged_decode_tpu",
    )(lengths.astype(jnp.int32), query_pos.astype(jnp.int32), slots.astype(jnp.int32),
      block_tables.astype(jnp.int32).reshape(-1), q, *tpu_tiles.page_operands(pages, cfg.pages_per_block),
      *sink_args)
