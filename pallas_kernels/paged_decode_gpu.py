"""Paged decode attention for GPU, any page format (dense, int8, fp8, int4/int2 KIVI): one Pallas kernel.

Lowering: **Pallas Triton**, chosen explicitly with `jax.experimental.pallas.triton.CompilerParams`
(since JAX 0.10 a GPU `pallas_call` without it goes to Mosaic GPU). The Triton backend is
deprecated from JAX 0.11 and Mosaic GPU is its successor; this kernel uses only generic Pallas
(ref gathers, masked loads, `fori_loop`, dots) and keeps its math in `common.py`, so a Mosaic
GPU port replaces the loads, not the softmax.

Reference: `jaxinfer.attention.reference.paged_attention_reference` with T = 1 (the engine's
"reference" path); tests/test_pallas_decode.py.

Shapes::

    q             [B, Hq, Dh]            one query per sequence (f32 / bf16 / f16)
    pages         KernelPages            k, v [P, page, Hkv, Dh] (int4: Dh/2 bytes) + scales, KIVI tails
    block_tables  i32[B, max_pages]      logical page -> physical page, read in-kernel
    lengths       i32[B]                 keys cached per sequence (this step's included)
    query_pos     i32[B]                 cache position of each query (default lengths - 1)
    sink_logits   f32[Hq] | None
    slots         i32[B] | None          cache slot of each row (KIVI tails: required; else default arange(B))
    ->            [B, Hq, Dh]            q.dtype

Grid (B, Hkv / H, k_splits). Program (b, h, s) takes H consecutive KV heads and the G = Hq / Hkv
query heads reading each: `rows` >= 16 (tl.dot's minimum) hold H groups of G (padded to a power
of two), H = 16 / G_pad where Hkv allows, so a GQA group of 4 fills a 16-row tile with 4 KV
heads instead of 12 rows of padding (gpu_tiles.py draws the tile). Each K/V page is read once
for the whole group::

    schedule of sequence b (common.page_schedule):  step 0 1 2 3 4 5 6 7 ...   count = 7
    k_splits = 2, steps_per_split = 4:              |- split 0 -|- split 1 -|
    pages_per_block = 2:                            [0 1][2 3]  [4 5][6 .]   (. masked, not read)
    step -> logical page -> block_tables[b, page] -> gather page of head h (masked load)

Each split folds its pages into an online-softmax carry and writes (m, l, acc); the wrapper
merges the splits and adds the sink logits (common.merge_partials / finalize). A KIVI
sequence's current page is read from its slot's tail by the split holding the last step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_tiles
from pallas_kernels.common import (AttentionOptions, cdiv, check_decode_shapes, check_sink_logits, decode_steps,
                                   finalize, init_carry, merge_partials, next_power_of_2, page_schedule)
from pallas_kernels.formats import KernelPages

MIN_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16


def _kernel(lengths_ref, query_pos_ref, slots_ref, bt_ref, q_ref, *refs, cfg: gpu_tiles.TileConfig,
            steps_per_split: int):
    k_refs, v_refs, tail_refs, (acc_ref, m_ref, l_ref) = gpu_tiles.split_refs(refs, cfg)
    b, split = pl.program_id(0), pl.program_id(2)
    length, query_pos = lengths_ref[b], query_pos_ref[b]
    sched = page_schedule(length, query_pos, query_pos, cfg.page_size, cfg.opts)
    count = sched.count
    if cfg.has_tail:  # the current page comes from the tail, not the pool
        use_tail = gpu_tiles.tail_scheduled(sched, length, cfg.page_size)
        count = count - use_tail.astype(jnp.int32)
    start = split * steps_per_split
    stop = jnp.minimum(start + steps_per_split, count)
    q = gpu_tiles.load_q_parts(q_ref, cfg.parts)
    carry = init_carry(q_ref.shape[0], q_ref.shape[1], cfg.parts)
    carry = gpu_tiles.walk_pages(carry, q, (k_refs, v_refs), bt_ref, sched, start, stop, length, query_pos,
                                 query_pos, None, cfg)
    if cfg.has_tail:  # the split holding the last schedule step reads the tail
        mine = use_tail & (count // steps_per_split == split)
        carry = jax.lax.cond(
            mine, lambda c: gpu_tiles.attend_tail(c, q, tail_refs, slots_ref[b], length, query_pos, query_pos,
                                                  None, cfg),
            lambda c: c, carry)
    gpu_tiles.store_parts(acc_ref, carry.acc)
    m_ref[...] = carry.m.reshape(-1)
    l_ref[...] = carry.l.reshape(-1)


@functools.partial(jax.jit, static_argnames=("scale", "opts", "pages_per_block", "k_splits", "interpret",
                                             "num_warps", "num_stages"))
def paged_decode_gpu(
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
    k_splits: int | None = None,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Decode attention through block tables -> [B, Hq, Dh] (see the module docstring)."""
    b, hq, dh = q.shape
    query_pos = lengths - 1 if query_pos is None else query_pos
    slots = pages.row_slots(slots, b)
    pages.validate()
    check_decode_shapes(q, pages, block_tables, lengths, query_pos)
    check_sink_logits(sink_logits, hq)
    hkv, page_size, max_pages = pages.num_kv_heads, pages.page_size, block_tables.shape[1]
    group = hq // hkv
    heads, rows = packed_heads(group, hkv)
    g_rows, blocks = rows // heads, hkv // heads  # rows per KV head, head blocks
    steps = decode_steps(max_pages, page_size, opts)  # a window caps the walk: split that, not max_pages
    ppb = pages_per_block or gpu_tiles.default_pages_per_block(page_size, steps, gpu_tiles.key_bytes(pages, heads, dh))
    splits = k_splits or default_k_splits(b * blocks, cdiv(steps, ppb))
    if not interpret:
        check_triton_shapes(page_size, dh // pages.parts, ppb)
    steps_per_split = cdiv(cdiv(steps, splits), ppb) * ppb
    cfg = gpu_tiles.TileConfig.of(pages, pages_per_block=ppb, max_pages=max_pages, opts=opts, scale=scale,
                                  heads=heads)

    q_rows = jnp.pad(q.reshape(b, hkv, group, dh), ((0, 0), (0, 0), (0, g_rows - group), (0, 0)))
    q_rows = q_rows.reshape(b, blocks, rows, dh)  # row r of block h: KV head h * heads + r // g_rows
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, steps_per_split=steps_per_split),
        grid=(b, blocks, splits),
        in_specs=[
            gpu_tiles.whole(lengths), gpu_tiles.whole(query_pos), gpu_tiles.whole(slots),
            pl.BlockSpec((None, max_pages), lambda b_, h, s: (b_, 0)),
            pl.BlockSpec((None, None, rows, dh), lambda b_, h, s: (b_, h, 0, 0)),
            *gpu_tiles.part_specs(pages, lambda b_, h, s: h, heads),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dh), lambda b_, h, s: (s, b_, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b_, h, s: (s, b_, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b_, h, s: (s, b_, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, b, blocks, rows, dh), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, blocks, rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, blocks, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_gpu",
    )(lengths.astype(jnp.int32), query_pos.astype(jnp.int32), slots.astype(jnp.int32),
      block_tables.astype(jnp.int32), q_rows, *gpu_tiles.page_operands(pages))

    m, l, acc = merge_partials(m[..., None], l[..., None], acc)  # [B, blocks, rows, ...]
    sink = None
    if sink_logits is not None:
        sink = jnp.pad(sink_logits.astype(jnp.float32).reshape(hkv, group), ((0, 0), (0, g_rows - group)))
        sink = jnp.broadcast_to(sink.reshape(1, blocks, rows, 1), (b, blocks, rows, 1))
    out = finalize(m, l, acc, sink).reshape(b, hkv, g_rows, dh)[:, :, :group]
    return out.reshape(b, hq, dh).astype(q.dtype)


def packed_heads(group: int, num_kv_heads: int) -> tuple[int, int]:
    """(KV heads per program H, tile rows R): groups padded to a power of two G_pad, H = the
    largest power of two <= 16 / G_pad dividing num_kv_heads, R = max(16, H * G_pad)."""
    g_pad = next_power_of_2(group)
    heads = max(1, MIN_ROWS // g_pad)
    while num_kv_heads % heads:
        heads //= 2
    return heads, max(MIN_ROWS, heads * g_pad)


def default_k_splits(programs: int, blocks_per_seq: int, target_programs: int = 256) -> int:
    """Split the key axis until the grid has about `target_programs` programs (flash-decoding)."""
    return int(max(1, min(blocks_per_seq, cdiv(target_programs, programs))))


def check_triton_shapes(page_size: int, head_dim: int, pages_per_block: int) -> None:
    """Triton loads and dots need power-of-two tiles with dot dimensions >= 16."""
    for name, n in (("page_size", page_size), ("head_dim", head_dim), ("pages_per_block", pages_per_block)):
        if n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two for the Triton lowering")
    if head_dim < MIN_ROWS or page_size * pages_per_block < MIN_ROWS:
        raise ValueError(f"{head_dim=} and page_size*pages_per_block={page_size * pages_per_block} must be >= 16")
