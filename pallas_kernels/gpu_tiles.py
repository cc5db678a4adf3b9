"""The page walk shared by the GPU (Pallas Triton) kernels: block table, masked gathers, dequantization.

A GPU program owns `heads` consecutive KV heads of one sequence (decode packs the query heads
of several KV heads into one 16-row tile instead of padding one group to 16 rows; prefill
owns one KV head): every page array reaches it with a head block of that size
(`part_specs`), so a stored-values ref is [P, S, heads, X], a per-token scale ref
[P, S, heads], a KIVI key-scale ref [P, heads, D] and a KIVI tail ref [M, S, heads, D].
`walk_pages` runs the schedule steps [start, stop) `pages_per_block` pages at a time::

    steps -> logical pages (common.PageSchedule) -> block_tables[b, logical] (masked load)
          -> masked gathers of K/V pages of these heads (a masked element is not read)
          -> dequantize channel parts (formats.dequantize_part) -> common.attend_tile

A tile's keys are laid out (page, token, head): column c = (i * S + t) * heads + p, and query
row r belongs to head r // (rows / heads), so a row sees only its own head's columns::

    heads = 2, G = 4 query heads per KV head, 1 page of S = 2 tokens:
                 col: (t0,h0) (t0,h1) (t1,h0) (t1,h1)
    rows 0-3 (h0):      x               x
    rows 4-7 (h1):              x               x

`attend_tail` folds in a KIVI sequence's current page from its slot's full-precision tail.
Everything here lowers through the Pallas Triton backend: gathers become pointer tensors,
masks become masked loads, the int4 / int2 unpack is shifts and ands.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import AttentionOptions, Carry, PageSchedule, attend_tile, visible, visible_span
from pallas_kernels.formats import KernelPages, dequantize_part


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static facts a GPU kernel needs about the pages (hashable)."""

    fmt: str
    k_layouts: tuple[str, ...]
    v_layouts: tuple[str, ...]
    parts: int
    page_size: int
    pages_per_block: int
    max_pages: int
    has_tail: bool
    opts: AttentionOptions
    scale: float
    heads: int = 1  # KV heads per program; query rows [p * R / heads, (p + 1) * R / heads) read head p

    @classmethod
    def of(cls, pages: KernelPages, *, pages_per_block: int, max_pages: int, opts: AttentionOptions, scale: float,
           heads: int = 1):
        return cls(pages.format, pages.part_layouts("k"), pages.part_layouts("v"), pages.parts, pages.page_size,
                   pages_per_block, max_pages, pages.k_tail is not None, opts, scale, heads)


def page_operands(pages: KernelPages) -> tuple[jax.Array, ...]:
    """Arrays in the order the kernels take them: K parts, V parts, then the tails if any."""
    tails = (pages.k_tail, pages.v_tail) if pages.k_tail is not None else ()
    return (*pages.k_parts(), *pages.v_parts(), *tails)


def part_specs(pages: KernelPages, head_of, heads: int = 1) -> list[pl.BlockSpec]:
    """BlockSpecs (same order as `page_operands`) giving a program the whole pool of its `heads`
    KV heads. `head_of(*grid_ids)` is the program's head block (heads [head_of * heads, ...))."""
    layouts = (*pages.part_layouts("k"), *pages.part_layouts("v"), *(("token",) * 2 if pages.k_tail is not None else ()))
    specs = []
    for array, layout in zip(page_operands(pages), layouts):
        head_axis = 2 if layout == "token" else 1
        block = tuple(heads if axis == head_axis else n for axis, n in enumerate(array.shape))

        def index_map(*ids, head_axis=head_axis, ndim=array.ndim):
            return tuple(head_of(*ids) if axis == head_axis else 0 for axis in range(ndim))

        specs.append(pl.BlockSpec(block, index_map))
    return specs


# Bytes of K + V one step's tile may hold (all the program's heads). Triton's shared memory
# grows with it: on an H200 (jax 0.11.2) a tile of 128 keys x 4 heads x 128 bf16 (256 KiB)
# asked for 404 KiB, of 227 KiB there are; a 64 KiB tile stays near 100 KiB.
KEY_TILE_BYTES = 64 * 1024


def default_pages_per_block(page_size: int, max_pages: int, key_bytes: int = 0) -> int:
    """Pages gathered per step: about 128 keys, fewer where a key's K + V bytes (`key_bytes`,
    all the program's heads) would pass KEY_TILE_BYTES; at least 16 keys (tl.dot's minimum);
    a power of two."""
    keys = 128 if key_bytes <= 0 else max(16, min(128, 1 << (KEY_TILE_BYTES // key_bytes).bit_length() - 1))
    return max(-(-16 // page_size), min(max(1, keys // page_size), 1 << max(max_pages - 1, 0).bit_length()))


def key_bytes(pages: KernelPages, heads: int, head_dim: int) -> int:
    """Bytes one key's K and V take in a step's tile for `heads` KV heads: as stored (values and
    scales), or dequantized to 16 bits where that is more (quantized tiles are converted in
    the kernel). KIVI tails, read once per sequence, are not counted."""
    stored = sum(a.size * a.dtype.itemsize for a in (*pages.k_parts(), *pages.v_parts()))
    stored //= pages.num_pages * pages.page_size * pages.num_kv_heads
    return heads * max(stored, 2 * head_dim * 2)


def whole(array: jax.Array) -> pl.BlockSpec:
    """A BlockSpec handing every program the whole (small) array: lengths, positions, slots."""
    return pl.BlockSpec(array.shape, lambda *_: (0,) * array.ndim)


def split_refs(refs, cfg: TileConfig):
    """Kernel refs after q -> (k refs, v refs, tail refs or None, remaining refs)."""
    n_k, n_v = len(cfg.k_layouts), len(cfg.v_layouts)
    k_refs, v_refs, rest = refs[:n_k], refs[n_k:n_k + n_v], refs[n_k + n_v:]
    if cfg.has_tail:
        return k_refs, v_refs, rest[:2], rest[2:]
    return k_refs, v_refs, None, rest


def load_q_parts(q_ref, parts: int) -> tuple[jax.Array, ...]:
    """q_ref [R, D] -> channel parts [R, D / parts] (contiguous loads, no register slicing)."""
    width = q_ref.shape[-1] // parts
    return tuple(q_ref[:, pl.ds(i * width, width)] for i in range(parts))


def store_parts(ref, parts: tuple[jax.Array, ...]) -> None:
    width = parts[0].shape[-1]
    for i, part in enumerate(parts):
        ref[:, pl.ds(i * width, width)] = part


def walk_pages(carry: Carry, q, refs, bt_ref, sched: PageSchedule, start, stop, length, q_lo, q_hi,
               row_pos, cfg: TileConfig) -> Carry:
    """Fold schedule steps [start, stop) into the carry. row_pos: i32[R, 1] per-row query
    positions (prefill) or None (decode: every row's query sits at q_lo == q_hi)."""
    k_refs, v_refs = refs

    def body(i, carry):
        steps = start + i * cfg.pages_per_block + jnp.arange(cfg.pages_per_block, dtype=jnp.int32)
        in_block = steps < stop
        logical = jnp.clip(sched.logical_page(steps), 0, cfg.max_pages - 1)
        page_ids = plgpu.load(bt_ref.at[logical], mask=in_block, other=0)
        return _attend_pages(carry, q, k_refs, v_refs, (cfg.k_layouts, cfg.v_layouts), cfg.fmt, page_ids,
                             logical, in_block, length, q_lo, q_hi, row_pos, cfg)

    num_blocks = jnp.maximum(stop - start + cfg.pages_per_block - 1, 0) // cfg.pages_per_block
    return jax.lax.fori_loop(0, num_blocks, body, carry)


def tail_scheduled(sched: PageSchedule, length, page_size: int) -> jax.Array:
    """bool: the schedule's last step is the sequence's current page (KIVI: read from the tail)."""
    return (sched.count > 0) & (sched.logical_page(sched.count - 1) == length // page_size)


def attend_tail(carry: Carry, q, tail_refs, slot, length, q_lo, q_hi, row_pos, cfg: TileConfig) -> Carry:
    """Fold in the current page of the sequence in slot `slot` from the full-precision tail."""
    logical = jnp.full((1,), length // cfg.page_size, jnp.int32)
    in_block = jnp.full((1,), True)
    page_ids = jnp.full((1,), slot, jnp.int32)
    layouts = (("token",), ("token",))
    return _attend_pages(carry, q, tail_refs[:1], tail_refs[1:], layouts, "dense", page_ids, logical, in_block,
                         length, q_lo, q_hi, row_pos, cfg)


def _attend_pages(carry, q, k_refs, v_refs, layouts, fmt, page_ids, logical, in_block, length, q_lo, q_hi,
                  row_pos, cfg: TileConfig) -> Carry:
    key_pos = logical[:, None] * cfg.page_size + jnp.arange(cfg.page_size, dtype=jnp.int32)[None, :]  # [n, S]
    ok = in_block[:, None] & visible_span(key_pos, q_lo, q_hi, length, cfg.opts)  # read only these keys
    k = load_kv_tile(fmt, k_refs, layouts[0], page_ids, ok, in_block, cfg.parts)
    v = load_kv_tile(fmt, v_refs, layouts[1], page_ids, ok, in_block, cfg.parts)
    n, heads = ok.shape[0] * ok.shape[1] * cfg.heads, cfg.heads
    col_ok = jnp.broadcast_to(ok[:, :, None], (*ok.shape, heads)).reshape(1, n)  # columns (page, token, head)
    vis = col_ok
    if heads > 1:
        col_head = jax.lax.broadcasted_iota(jnp.int32, (*ok.shape, heads), 2).reshape(1, n)
        row_head = jax.lax.broadcasted_iota(jnp.int32, (q[0].shape[0], 1), 0) // (q[0].shape[0] // heads)
        vis = vis & (row_head == col_head)
    if row_pos is not None:
        col_pos = jnp.broadcast_to(key_pos[:, :, None], (*ok.shape, heads)).reshape(1, n)
        vis = vis & visible(col_pos, row_pos, length, cfg.opts)
    return attend_tile(carry, q, k, v, vis, col_ok.reshape(n, 1), scale=cfg.scale, soft_cap=cfg.opts.soft_cap)


def load_kv_tile(fmt: str, refs, layouts, page_ids, key_ok, in_block, parts: int) -> tuple[jax.Array, ...]:
    """Gather pages `page_ids` (i32[n]) of the program's heads -> channel parts, each
    [n * S * heads, D / parts] (rows: page, token, head).

    key_ok bool[n, S] masks per token (those keys are not read and come back as 0); in_block
    bool[n] masks per page for the KIVI per-channel key scales.
    """
    stored_ref, *scale_refs = refs
    packed = fmt in ("int4", "int2")
    width = stored_ref.shape[-1] if packed else stored_ref.shape[-1] // parts
    out = []
    for i in range(parts):
        stored = masked_gather(stored_ref, page_ids, key_ok, 0 if packed else i * width, width)  # [n, S, heads, w]
        scales = []
        for ref, layout in zip(scale_refs, layouts[1:]):
            if layout == "token":  # [P, S, heads] -> [n, S, heads, 1]
                scales.append(masked_gather(ref, page_ids, key_ok)[..., None])
            else:  # per channel [P, heads, D] -> part i: [n, 1, heads, width]
                scales.append(masked_gather(ref, page_ids, in_block, i * width, width)[:, None])
        x = dequantize_part(fmt, stored, i, *scales)
        out.append(x.reshape(x.shape[0] * x.shape[1] * x.shape[2], x.shape[3]))
    return tuple(out)


def masked_gather(ref, page_ids, lead_mask, channel_start: int | None = None, channels: int | None = None):
    """ref [P, ...] -> [n, ...] at pages `page_ids`, elements under False in `lead_mask` (which
    covers the leading result axes) not read and 0; the last axis optionally sliced."""
    shape = [page_ids.shape[0], *ref.shape[1:]]
    if channels is not None:
        shape[-1] = channels
    ndim = len(shape)
    index = [page_ids.reshape(-1, *(1,) * (ndim - 1))]
    for axis in range(1, ndim):
        iota = jax.lax.broadcasted_iota(jnp.int32, (1,) * axis + (shape[axis],) + (1,) * (ndim - axis - 1), axis)
        index.append(iota + channel_start if (axis == ndim - 1 and channels is not None) else iota)
    index = tuple(jnp.broadcast_to(i, shape) for i in index)
    mask = jnp.broadcast_to(lead_mask.reshape(*lead_mask.shape, *(1,) * (ndim - lead_mask.ndim)), shape)
    return plgpu.load(ref.at[index], mask=mask, other=jnp.zeros((), ref.dtype))
