"""The page walk shared by the TPU (Pallas Mosaic TPU) kernels: one page per grid step.

Block tables, lengths, slots and query spans are scalar-prefetched (SMEM) and drive the index
maps: grid step i of a query block fetches physical page `block_tables[b, page(i)]`, where
page(i) walks `common.PageSchedule` (sink pages, then window pages); steps past the schedule
re-name the last page, so the pipeline fetches nothing new and the kernel skips them::

    step i:        0   1   2   3   4 ...
    logical page:  0   4   5   5   5        (count = 3; steps 3.. idle)
    physical page: bt[b,0] bt[b,4] bt[b,5] (same block: no DMA)

A page block holds every KV head ([S, Hkv, X]: the last two dims are whole, as Mosaic
requires), so one DMA serves all query heads; the kernel loops over KV heads statically and
keeps the online-softmax carry in VMEM scratch. A KIVI tail row (the sequence's current
page) is one more block, fetched once per sequence; the step after the pool pages reads it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import AttentionOptions, Carry, PageSchedule, attend_tile, page_schedule, visible, visible_span
from pallas_kernels.formats import KernelPages, dequantize_part


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Static facts a TPU kernel needs about the pages (hashable)."""

    fmt: str
    k_layouts: tuple[str, ...]
    v_layouts: tuple[str, ...]
    parts: int
    page_size: int
    num_kv_heads: int
    max_pages: int
    has_tail: bool
    opts: AttentionOptions
    scale: float

    @classmethod
    def of(cls, pages: KernelPages, *, max_pages: int, opts: AttentionOptions, scale: float):
        return cls(pages.format, pages.part_layouts("k"), pages.part_layouts("v"), pages.parts, pages.page_size,
                   pages.num_kv_heads, max_pages, pages.k_tail is not None, opts, scale)


class Walk:
    """Where a query block's walk stands: its schedule, pool steps, and whether it reads a tail."""

    def __init__(self, length, q_lo, q_hi, cfg: TpuConfig):
        self.sched: PageSchedule = page_schedule(length, q_lo, q_hi, cfg.page_size, cfg.opts)
        self.use_tail = jnp.zeros((), jnp.bool_)
        self.pool_steps = self.sched.count
        if cfg.has_tail:
            last = self.sched.logical_page(self.sched.count - 1)
            self.use_tail = (self.sched.count > 0) & (last == length // cfg.page_size)
            self.pool_steps = self.sched.count - self.use_tail.astype(jnp.int32)

    def physical_page(self, bt_ref, b, step, max_pages: int):
        """Physical page of pool step `step` (past the pool steps: the last one, or page bt[b, 0])."""
        last = jnp.maximum(jnp.minimum(step, self.pool_steps - 1), 0)
        logical = jnp.clip(self.sched.logical_page(last), 0, max_pages - 1)
        return bt_ref[b * max_pages + logical]


def page_specs(pages: KernelPages, page_of, slot_of) -> list[pl.BlockSpec]:
    """BlockSpecs for (K parts, V parts, tails): one page (all heads) per step, a tail row per sequence.

    `page_of(*grid_ids, *prefetch_refs)` / `slot_of(...)` name the page / slot a step reads.
    """
    specs = []
    layouts = (*pages.part_layouts("k"), *pages.part_layouts("v"))
    for array, layout in zip((*pages.k_parts(), *pages.v_parts()), layouts):
        rest = array.shape[1:]
        specs.append(pl.BlockSpec((None, *rest), lambda *a, n=len(rest): (page_of(*a),) + (0,) * n))
    if pages.k_tail is not None:
        for tail in (pages.k_tail, pages.v_tail):
            specs.append(pl.BlockSpec((None, *tail.shape[1:]), lambda *a: (slot_of(*a), 0, 0, 0)))
    return specs


def page_operands(pages: KernelPages) -> tuple[jax.Array, ...]:
    tails = (pages.k_tail, pages.v_tail) if pages.k_tail is not None else ()
    return (*pages.k_parts(), *pages.v_parts(), *tails)


def split_refs(refs, cfg: TpuConfig):
    """Kernel refs after q -> (k refs, v refs, tail refs or None, remaining refs)."""
    n_k, n_v = len(cfg.k_layouts), len(cfg.v_layouts)
    k_refs, v_refs, rest = refs[:n_k], refs[n_k:n_k + n_v], refs[n_k + n_v:]
    if cfg.has_tail:
        return k_refs, v_refs, rest[:2], rest[2:]
    return k_refs, v_refs, None, rest


def q_parts(q: jax.Array, parts: int) -> tuple[jax.Array, ...]:
    width = q.shape[-1] // parts
    return tuple(q[:, i * width:(i + 1) * width] for i in range(parts))


def attend_head(carry: Carry, q, h: int, k_refs, v_refs, layouts, fmt: str, logical, length, q_lo, q_hi,
                row_pos, cfg: TpuConfig) -> Carry:
    """Fold KV head h of the page in the current blocks (logical page `logical`) into the carry.

    q: channel parts [R, D / parts] of the rows reading head h; row_pos i32[R, 1] or None
    (decode: every row's query sits at q_lo == q_hi).
    """
    s = cfg.page_size
    key_pos = logical * s + jax.lax.broadcasted_iota(jnp.int32, (1, s), 1)  # [1, S]
    key_ok = visible_span(logical * s + jax.lax.broadcasted_iota(jnp.int32, (s, 1), 0), q_lo, q_hi, length,
                          cfg.opts)  # [S, 1]
    vis = visible_span(key_pos, q_lo, q_hi, length, cfg.opts)
    if row_pos is not None:
        vis = vis & visible(key_pos, row_pos, length, cfg.opts)
    k = load_head(fmt, k_refs, layouts[0], h, cfg.parts)
    v = load_head(fmt, v_refs, layouts[1], h, cfg.parts)
    return attend_tile(carry, q, k, v, vis, key_ok, scale=cfg.scale, soft_cap=cfg.opts.soft_cap)


def load_head(fmt: str, refs, layouts, h: int, parts: int) -> tuple[jax.Array, ...]:
    """KV head h of one page block -> dequantized channel parts [S, D / parts].

    Refs: stored [S, H, X], per-token scales [S, H], KIVI key scales [H, D].
    """
    stored_ref, *scale_refs = refs
    packed = fmt in ("int4", "int2")
    stored = stored_ref[:, h, :]  # [S, X]
    width = stored.shape[-1] if packed else stored.shape[-1] // parts
    out = []
    for i in range(parts):
        values = stored if packed else stored[:, i * width:(i + 1) * width]
        scales = []
        for ref, layout in zip(scale_refs, layouts[1:]):
            if layout == "token":
                scales.append(ref[:, pl.ds(h, 1)])  # [S, 1]
            else:
                scales.append(ref[pl.ds(h, 1), pl.ds(i * width, width)])  # [1, width]
        out.append(dequantize_part(fmt, values, i, *scales))
    return tuple(out)


def read_carry(m_ref, l_ref, acc_ref, index, parts: int) -> Carry:
    """The carry rows at `index` (a tuple of static indices/slices into the scratch refs)."""
    acc = acc_ref[index]
    width = acc.shape[-1] // parts
    return Carry(m_ref[index], l_ref[index], tuple(acc[:, i * width:(i + 1) * width] for i in range(parts)))


def write_carry(m_ref, l_ref, acc_ref, index, carry: Carry) -> None:
    m_ref[index] = carry.m
    l_ref[index] = carry.l
    acc_ref[index] = carry.acc[0] if len(carry.acc) == 1 else jnp.concatenate(carry.acc, axis=-1)
