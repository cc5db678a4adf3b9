"""Chunked-prefill attention over paged KV for GPU, any page format: one Pallas kernel.

Lowering: **Pallas Triton**, chosen explicitly with `jax.experimental.pallas.triton.CompilerParams`
(deprecated from JAX 0.11; Mosaic GPU is its successor: see paged_decode_gpu.py).

Reference: `jaxinfer.attention.reference.paged_attention_reference` (the engine's "reference" path).

Shapes::

    q             [B, T, Hq, Dh]         a chunk of T queries per sequence
    pages         KernelPages            k, v [P, S, Hkv, Dh] (+ scales, KIVI tails)
    block_tables  i32[B, max_pages]
    lengths       i32[B]                 keys cached per sequence, this chunk's included
    query_pos     i32[B, T]              cache position of each query (causal limit)
    sink_logits   f32[Hq] | None
    slots         i32[B] | None          cache slot of each row (KIVI tails)
    ->            [B, T, Hq, Dh]         q.dtype

Grid (B, Hkv, T_pad / block_q). Program (b, h, j) owns `block_q` queries of sequence b times
the G query heads of KV head h: rows = block_q * G_pad (a power of two >= 16), row
r = t * G_pad + g. Causality inside the chunk is the per-row mask `key <= query_pos`; the
block reads only the pages some of its queries can see (common.page_schedule over the
block's [min, max] query position)::

    S = 4, chunk of 6 queries at positions 10..15, block_q = 2, no window:
    block 0 (10, 11): pages 0 1 2      block 1 (12, 13): pages 0..3      block 2: pages 0..3
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_tiles
from pallas_kernels.common import (AttentionOptions, cdiv, check_prefill_shapes, check_sink_logits, finalize,
                                   init_carry, next_power_of_2, page_schedule, prefill_rows)
from pallas_kernels.formats import KernelPages
from pallas_kernels.paged_decode_gpu import MIN_ROWS, check_triton_shapes


def _kernel(lengths_ref, slots_ref, q_lo_ref, q_hi_ref, bt_ref, row_pos_ref, q_ref, *refs,
            cfg: gpu_tiles.TileConfig, has_sinks: bool):
    k_refs, v_refs, tail_refs, rest = gpu_tiles.split_refs(refs, cfg)
    sink_ref, o_ref = rest if has_sinks else (None, *rest)
    b, j = pl.program_id(0), pl.program_id(2)
    length, q_lo, q_hi = lengths_ref[b], q_lo_ref[b, j], q_hi_ref[b, j]
    row_pos = row_pos_ref[...].reshape(-1, 1)
    sched = page_schedule(length, q_lo, q_hi, cfg.page_size, cfg.opts)
    stop = sched.count
    if cfg.has_tail:
        use_tail = gpu_tiles.tail_scheduled(sched, length, cfg.page_size)
        stop = stop - use_tail.astype(jnp.int32)
    q = gpu_tiles.load_q_parts(q_ref, cfg.parts)
    carry = init_carry(q_ref.shape[0], q_ref.shape[1], cfg.parts)
    carry = gpu_tiles.walk_pages(carry, q, (k_refs, v_refs), bt_ref, sched, 0, stop, length, q_lo, q_hi,
                                 row_pos, cfg)
    if cfg.has_tail:
        carry = jax.lax.cond(
            use_tail, lambda c: gpu_tiles.attend_tail(c, q, tail_refs, slots_ref[b], length, q_lo, q_hi, row_pos, cfg),
            lambda c: c, carry)
    sink = sink_ref[...].reshape(-1, 1) if has_sinks else None
    out = tuple(finalize(carry.m, carry.l, acc, sink).astype(o_ref.dtype) for acc in carry.acc)
    gpu_tiles.store_parts(o_ref, out)


@functools.partial(jax.jit, static_argnames=("scale", "opts", "block_q", "pages_per_block", "interpret",
                                             "num_warps", "num_stages"))
def chunked_prefill_gpu(
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
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Attention of a chunk of queries through block tables -> [B, T, Hq, Dh] (module docstring)."""
    b, t, hq, dh = q.shape
    slots = pages.row_slots(slots, b)
    pages.validate()
    check_prefill_shapes(q, pages, block_tables, lengths, query_pos)
    check_sink_logits(sink_logits, hq)
    hkv, page_size, max_pages = pages.num_kv_heads, pages.page_size, block_tables.shape[1]
    group = hq // hkv
    g_pad = next_power_of_2(group)
    bq = block_q or max(MIN_ROWS // g_pad, min(max(1, 64 // g_pad), next_power_of_2(t)))
    t_pad = cdiv(t, bq) * bq
    rows = bq * g_pad
    ppb = pages_per_block or gpu_tiles.default_pages_per_block(page_size, max_pages, gpu_tiles.key_bytes(pages, 1, dh))
    if not interpret:
        check_triton_shapes(page_size, dh // pages.parts, ppb)
        if rows < MIN_ROWS or rows & (rows - 1):
            raise ValueError(f"block_q * G_pad = {rows} must be a power of two >= {MIN_ROWS}")
    cfg = gpu_tiles.TileConfig.of(pages, pages_per_block=ppb, max_pages=max_pages, opts=opts, scale=scale)

    q_rows, row_pos, q_lo, q_hi = prefill_rows(q, query_pos, hkv, g_pad, t_pad, bq)
    sink_args, sink_specs = (), []
    if sink_logits is not None:
        sink = jnp.pad(sink_logits.astype(jnp.float32).reshape(hkv, group), ((0, 0), (0, g_pad - group)))
        sink_args = (jnp.tile(sink, (1, bq)),)  # [Hkv, rows]: row r has head r % G_pad
        sink_specs = [pl.BlockSpec((None, rows), lambda b_, h, j: (h, 0))]
    out = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, has_sinks=sink_logits is not None),
        grid=(b, hkv, t_pad // bq),
        in_specs=[
            gpu_tiles.whole(lengths), gpu_tiles.whole(slots), gpu_tiles.whole(q_lo), gpu_tiles.whole(q_hi),
            pl.BlockSpec((None, max_pages), lambda b_, h, j: (b_, 0)),
            pl.BlockSpec((None, rows), lambda b_, h, j: (b_, j)),
            pl.BlockSpec((None, None, rows, dh), lambda b_, h, j: (b_, h, j, 0)),
            *gpu_tiles.part_specs(pages, lambda b_, h, j: h),
            *sink_specs,
        ],
        out_specs=pl.BlockSpec((None, None, rows, dh), lambda b_, h, j: (b_, h, j, 0)),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="chunked_prefill_gpu",
    )(lengths.astype(jnp.int32), slots.astype(jnp.int32), q_lo, q_hi, block_tables.astype(jnp.int32), row_pos,
      q_rows, *gpu_tiles.page_operands(pages), *sink_args)
    out = out.reshape(b, hkv, t_pad, g_pad, dh)[:, :, :t, :group]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dh)
