"""The page walk shared by the TPU (Pallas Mosaic TPU) kernels: a block of pages per grid step.

Block tables, lengths, slots and query spans are scalar-prefetched (SMEM) and drive the index
maps. Grid step i of a query block reads schedule steps [i * ppb, (i + 1) * ppb) of
`common.PageSchedule` (sink pages, then window pages), one page per *page slot* j < ppb: each
slot is an operand of its own whose index map names physical page
`block_tables[b, page(i * ppb + j)]`, so a step issues up to ppb page DMAs, and Pallas's
pipeline fetches step i + 1's pages while step i computes (double buffering). A slot past the
end of the walk re-names the page it read last, so the pipeline fetches nothing new for it and
the kernel masks it::

    ppb = 4, schedule count = 6 (logical pages 0 4 5 6 7 8)
    grid step:       0                  1                  2 ...
    slot 0 1 2 3:    0  4  5  6         7  8  5* 6*        7* 8* 5* 6*    (* re-named: no DMA)

The walk thus stops at each sequence's length (and window): later steps fetch and compute
nothing; only empty grid steps remain, cdiv(steps, ppb) per query block in all (steps:
max_pages, or for decode with a window the most pages a window and the sinks span).

A page block holds every KV head ([S, Hkv, X]: the last two dims are whole, as Mosaic
requires), so one DMA serves all query heads; the kernel loops over KV heads statically,
folds a step's ppb pages of a head into one [rows, ppb * S] score tile (one matmul), and keeps
the online-softmax carry in VMEM scratch. A KIVI tail row (the sequence's current page) is
one more block, fetched once per sequence and read at the step holding schedule step
`pool_steps`.
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
    pages_per_block: int
    has_tail: bool
    opts: AttentionOptions
    scale: float
    steps: int  # most schedule steps a query block can have (decode with a window: fewer than max_pages)

    @classmethod
    def of(cls, pages: KernelPages, *, max_pages: int, opts: AttentionOptions, scale: float,
           pages_per_block: int | None = None, steps: int | None = None):
        steps = steps or max_pages
        ppb = pages_per_block or default_pages_per_block(pages.page_size, steps)
        if ppb <= 0:
            raise ValueError(f"pages_per_block={ppb} must be positive")
        return cls(pages.format, pages.part_layouts("k"), pages.part_layouts("v"), pages.parts, pages.page_size,
                   pages.num_kv_heads, max_pages, ppb, pages.k_tail is not None, opts, scale, steps)

    @property
    def num_blocks(self) -> int:
        """Grid steps per query block: cdiv(steps, pages_per_block)."""
        return -(-self.steps // self.pages_per_block)


def default_pages_per_block(page_size: int, max_pages: int) -> int:
    """Pages per grid step: about 128 keys (8 pages of 16, 2 of 64), at most max_pages."""
    return max(1, min(max_pages, 128 // page_size))


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

    def slot_step(self, block, slot: int, ppb: int):
        """Schedule step page slot `slot` reads at grid step `block`: block * ppb + slot, or past
        the pool steps the slot's own last step (its block is then unchanged: no DMA), or the
        last pool step when the slot has none."""
        step = block * ppb + slot
        past = jnp.maximum(step - self.pool_steps + 1, 0)
        own_last = step - ppb * ((past + ppb - 1) // ppb)
        return jnp.where(step < self.pool_steps, step, jnp.where(own_last >= 0, own_last, self.pool_steps - 1))

    def physical_page(self, bt_ref, b, block, slot: int, cfg: TpuConfig):
        """Physical page page slot `slot` holds at grid step `block` (page bt[b, 0] for an empty walk)."""
        step = jnp.maximum(self.slot_step(block, slot, cfg.pages_per_block), 0)
        logical = jnp.clip(self.sched.logical_page(step), 0, cfg.max_pages - 1)
        return bt_ref[b * cfg.max_pages + logical]


def page_specs(pages: KernelPages, page_of, slot_of, ppb: int) -> list[pl.BlockSpec]:
    """BlockSpecs for (per page slot: K parts, V parts) x ppb, then the tails: one page (all
    heads) per slot and step, a tail row per sequence.

    `page_of(slot, *grid_ids, *prefetch_refs)` / `slot_of(*grid_ids, *prefetch_refs)` name the
    page a slot reads / the sequence's cache slot.
    """
    specs = []
    for j in range(ppb):
        for array in (*pages.k_parts(), *pages.v_parts()):
            rest = array.shape[1:]
            specs.append(pl.BlockSpec((None, *rest), lambda *a, j=j, n=len(rest): (page_of(j, *a),) + (0,) * n))
    if pages.k_tail is not None:
        for tail in (pages.k_tail, pages.v_tail):
            specs.append(pl.BlockSpec((None, *tail.shape[1:]), lambda *a: (slot_of(*a), 0, 0, 0)))
    return specs


def page_operands(pages: KernelPages, ppb: int) -> tuple[jax.Array, ...]:
    """The arrays in `page_specs` order (each pool array once per page slot)."""
    tails = (pages.k_tail, pages.v_tail) if pages.k_tail is not None else ()
    return (*pages.k_parts(), *pages.v_parts()) * ppb + tails


def split_refs(refs, cfg: TpuConfig):
    """Kernel refs after q -> (per slot (k refs, v refs), tail refs or None, remaining refs)."""
    n_k, n_v = len(cfg.k_layouts), len(cfg.v_layouts)
    per_slot = n_k + n_v
    slots = tuple((refs[j * per_slot:j * per_slot + n_k], refs[j * per_slot + n_k:(j + 1) * per_slot])
                  for j in range(cfg.pages_per_block))
    rest = refs[cfg.pages_per_block * per_slot:]
    if cfg.has_tail:
        return slots, rest[:2], rest[2:]
    return slots, None, rest


def q_parts(q: jax.Array, parts: int) -> tuple[jax.Array, ...]:
    width = q.shape[-1] // parts
    return tuple(q[:, i * width:(i + 1) * width] for i in range(parts))


def block_keys(walk: Walk, block, cfg: TpuConfig):
    """Logical page i32[] and validity bool[] of each page slot at grid step `block`."""
    steps = [block * cfg.pages_per_block + j for j in range(cfg.pages_per_block)]
    return [(walk.sched.logical_page(s), s < walk.pool_steps) for s in steps]


def attend_head(carry: Carry, q, h: int, slot_refs, layouts, fmt: str, slot_pages, length, q_lo, q_hi,
                row_pos, cfg: TpuConfig) -> Carry:
    """Fold KV head h of the pages in the current slot blocks into the carry, as one tile.

    slot_refs: per slot (k refs, v refs); slot_pages: per slot (logical page, valid); q:
    channel parts [R, D / parts] of the rows reading head h; row_pos i32[R, 1] or None
    (decode: every row's query sits at q_lo == q_hi).
    """
    row_keys = key_positions(slot_pages, cfg.page_size, axis=1)  # [1, N]
    col_keys = key_positions(slot_pages, cfg.page_size, axis=0)  # [N, 1]
    key_ok = visible_span(col_keys, q_lo, q_hi, length, cfg.opts)  # [N, 1]
    vis = visible_span(row_keys, q_lo, q_hi, length, cfg.opts)  # [1, N]
    if row_pos is not None:
        vis = vis & visible(row_keys, row_pos, length, cfg.opts)
    k = _concat_parts([load_head(fmt, k_refs, layouts[0], h, cfg.parts) for k_refs, _ in slot_refs])
    v = _concat_parts([load_head(fmt, v_refs, layouts[1], h, cfg.parts) for _, v_refs in slot_refs])
    return attend_tile(carry, q, k, v, vis, key_ok, scale=cfg.scale, soft_cap=cfg.opts.soft_cap)


def key_positions(slot_pages, page_size: int, axis: int) -> jax.Array:
    """Cache position of each key of a step's tile (slot j's page fills keys [j * S, (j + 1) * S)),
    i32 laid along `axis` of a [1, N] / [N, 1] array; an invalid slot's keys lie past every length."""
    n = len(slot_pages) * page_size
    iota = jax.lax.broadcasted_iota(jnp.int32, (1, n) if axis == 1 else (n, 1), axis)
    never = jnp.iinfo(jnp.int32).max - page_size
    first = jnp.zeros_like(iota)
    for j, (logical, ok) in enumerate(slot_pages):
        first = jnp.where(iota // page_size == j, jnp.where(ok, logical * page_size, never), first)
    return first + iota % page_size


def _concat_parts(per_slot: list[tuple[jax.Array, ...]]) -> tuple[jax.Array, ...]:
    """Per slot channel parts [S, W] -> channel parts [slots * S, W]."""
    if len(per_slot) == 1:
        return per_slot[0]
    return tuple(jnp.concatenate(part, axis=0) for part in zip(*per_slot))


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
