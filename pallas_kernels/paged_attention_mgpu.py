"""Paged attention for Hopper GPUs (sm90: H100/H200) on **Pallas Mosaic GPU**: decode and chunked
prefill over dense bf16/f16, int8, fp8 and KIVI int4/int2 pages, one kernel.

Mosaic GPU is JAX's GPU lowering from 0.10 on (Pallas Triton is deprecated from 0.11): a
program is one warpgroup, pages move GMEM -> SMEM by TMA, and both matmuls run on the tensor
cores (`wgmma`, 64-row tiles). `paged_decode_mgpu` and `chunked_prefill_mgpu` have the
contracts of the Triton kernels `paged_decode_gpu` / `chunked_prefill_gpu`. On an H200 both
passed every check; Triton's decode ran 1.8x faster than `paged_decode_mgpu` (BENCHMARKS.md),
so the dispatch runs this kernel for chunked prefill on Hopper and Triton's for decode
(`jaxinfer.attention.dispatch.gpu_kernel_family`); KIVI pages have not run on a device here and
are not dispatched to it. Reference: `jaxinfer.attention.reference.paged_attention_reference`;
tests/test_pallas_mgpu.py runs these kernels in jax's GPU interpret mode on CPU.

Layout. A page holds S tokens of every KV head, [S, Hkv, Dh], contiguous: viewed as
[S * Hkv, Dh] it is a tile of keys in (token, head) order, and one TMA copy brings all heads of
a page. An *all-heads* program (decode; prefill over int8 / fp8 / KIVI pages) owns a sequence's heads,
so every key is read once and an int8 / fp8 page's per-token scales ([S, Hkv]) are one
contiguous row. Its query rows are the query heads (decode) or (query, head) pairs (prefill),
padded to 64 (wgmma's M); row r belongs to KV head (r % Hq) // G and sees only its head's
columns (the mask drawn in gpu_tiles.py). The tensor cores then also multiply other heads'
columns (a factor Hkv, masked): cheap for decode, bound by the pages' bytes. A *per-head*
program (prefill over dense pages) owns one KV head and (query, group head) rows, reading that
head's [S, Dh] slice of each page (a strided TMA copy), so prefill pays no such factor::

    tile (ppb pages, or one chunk of a page when a page has more keys than a tile holds):
      TMA  k, v pages [S*Hkv, Dh] (per-head: [S, Dh]) (+ scale rows) -> SMEM slot
           (double-buffered: the next tile's copy is in flight while this one computes)
      quantized: SMEM -> registers -> bf16 / f16 -> SMEM (the scales are applied to the
           scores' columns and to the probabilities' columns, so K and V only change dtype)
      V rows past the length -> 0 (their bytes may be anything, NaN included)
      s = q @ k^T (wgmma)  -> scale, soft-cap, mask, online softmax (common.py's formulas)
      acc += p @ v (wgmma)

KIVI (int4 / int2, all-heads programs). A stored byte holds code j of `parts = 8 / bits`
channel parts (part i: channels [i * w, (i + 1) * w), w = Dh / parts; formats.dequantize_part).
Queries, the converted K / V tiles and the output are split into the same parts ([parts, ., w]
each), so a tile's scores are a sum of `parts` wgmmas and each output part is a wgmma of its own::

      TMA  packed k, v [N, w] u8 + each page's key scale / zero rows [Hkv, Dh] + value scale / zero [N]
      K part i = zero + code * scale, per (page, head) row and channel (they vary along both
           axes of the tile: built in f32 registers, then bf16 SMEM)
      V part i = code (exact in bf16); the value scale goes on p's columns, the zero adds
           sum_n p[r, n] * zero[n] to every channel of row r
      the current page (the schedule's last step when it is `length // S`): after the pool
           walk, by the split owning that step, from the slot's bf16 tail straight into the
           converted tiles (by chunks, as a page), V past the length zeroed

Grid (B, query blocks, k_splits): split s walks schedule steps [s * n, (s + 1) * n) of
common.page_schedule over its block's query positions (sinks, window, length) and writes
(m, l, acc); the wrapper merges the splits and adds the sink logits (common.merge_partials /
finalize), as the Triton kernels do. Decode splits the key axis; prefill does not.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu_interpret
from pallas_kernels.common import (MASK_VALUE, AttentionOptions, cap_scores, cdiv, check_decode_shapes,
                                   check_prefill_shapes, check_sink_logits, decode_steps, finalize, merge_partials,
                                   page_schedule, query_blocks, visible)
from pallas_kernels.formats import KernelPages
from pallas_kernels.gpu_tiles import tail_scheduled

MGPU_FORMATS = ("dense", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")
ROWS = 64  # wgmma's M
MAX_KEYS = 256  # wgmma's largest N: keys per tile


@dataclasses.dataclass(frozen=True)
class MgpuTiles:
    """Static tiling of one call (hashable)."""

    fmt: str
    page_size: int
    kv_heads: int
    q_heads: int  # row r holds query head r % q_heads
    group: int  # query heads per KV head
    rows: int  # query rows, a multiple of 64
    head_dim: int
    tile_heads: int  # KV heads in a tile: all (Hkv), or 1 (per-head programs: dense prefill)
    head_blocks: int  # per-head programs: query blocks per KV head (block j reads head j // head_blocks)
    pages_per_step: int  # pages per tile (pages_per_step * S * tile_heads keys) ...
    chunks: int  # ... or chunks per page (one page of S * tile_heads keys in `chunks` tiles)
    steps_per_split: int  # schedule steps (pages) per split, a multiple of pages_per_step
    opts: AttentionOptions
    scale: float
    interpret: bool

    @property
    def keys(self) -> int:
        """Keys per tile (N)."""
        return self.pages_per_step * self.page_size * self.tile_heads // self.chunks

    @property
    def quantized(self) -> bool:
        return self.fmt != "dense"

    @property
    def kind(self) -> str:
        """"dense", "token" (int8 / fp8: per-token scales) or "kivi" (int4 / int2)."""
        return {"dense": "dense", "int4": "kivi", "int2": "kivi"}.get(self.fmt, "token")

    @property
    def parts(self) -> int:
        """Channel parts a stored byte holds (KIVI: 8 / bits; else 1)."""
        return {"int4": 2, "int2": 4}.get(self.fmt, 1)


def tiles_for(pages: KernelPages, rows: int, per_head: bool = False) -> tuple[int, int]:
    """(pages per tile, chunks per page) for `rows` query rows. A tile holds a multiple of 64 keys (the V
    tile's register layout): several small pages, one page, or a chunk of a large one, as
    many keys as fit SMEM (`smem_bytes`) up to 256 (wgmma's largest N; 128 for row blocks
    over 64, whose registers run out first)."""
    page_keys = pages.page_size * (1 if per_head else pages.num_kv_heads)
    if page_keys <= ROWS:
        return max(1, ROWS // page_keys), 1
    chunks = max(1, page_keys // (MAX_KEYS if rows == ROWS else MAX_KEYS // 2))
    while smem_bytes(pages, rows, page_keys // chunks) > SMEM_BYTES and page_keys // chunks > ROWS:
        chunks *= 2
    return 1, chunks


SMEM_BYTES = 227 * 1024  # an H100 / H200 block's shared memory


def smem_bytes(pages: KernelPages, rows: int, keys: int) -> int:
    """Shared memory of one program: double-buffered K/V stages (+ f32 scales and the tiles a
    quantized format converts into; KIVI: + key scale / zero rows, value zeros), the queries
    and the probabilities."""
    dh, compute = pages.head_dim, jnp.dtype(compute_dtype(pages)).itemsize
    stored = pages.k.shape[-1] * jnp.dtype(pages.k.dtype).itemsize  # bytes of a stored key row (KIVI: packed)
    total = 2 * 2 * keys * stored + rows * dh * compute + rows * keys * compute + rows * 4
    if pages.format != "dense":
        total += 2 * keys * dh * compute + 2 * 2 * keys * 4  # (scales at f32: an upper bound)
    if pages.is_kivi:  # value zeros; key scales and zeros: one [Hkv, Dh] bf16 row block per page of a tile
        total += 2 * keys * 4 + 2 * 2 * cdiv(keys, pages.page_size) * dh * 2
    return total


def check_mgpu_shapes(pages: KernelPages, rows: int, per_head: bool = False) -> None:
    """What this kernel's tiles need for `rows` query rows; raises ValueError naming the size
    (the dispatch then uses the Triton kernel)."""
    if pages.format not in MGPU_FORMATS:
        raise ValueError(f"the Mosaic GPU decode kernel reads {MGPU_FORMATS} pages, not {pages.format}")
    if pages.format == "dense" and pages.k.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"the Mosaic GPU decode kernel reads bf16/f16 dense pages, not {pages.k.dtype}")
    dh, page_keys = pages.head_dim, pages.page_size * (1 if per_head else pages.num_kv_heads)
    if per_head and pages.format != "dense":
        raise ValueError("per-head programs read dense pages only (a head's scales are not contiguous)")
    if dh % 64:
        raise ValueError(f"head_dim={dh} must be a multiple of 64 (the 128-byte swizzled SMEM tiles)")
    if pages.is_kivi and pages.k_tail is None:
        raise ValueError(f"{pages.format} pages need their tails (the current page)")
    ppb, chunks = tiles_for(pages, rows, per_head)
    keys = ppb * page_keys // chunks
    if keys % ROWS or page_keys % chunks or (ppb > 1 and ROWS % page_keys):
        raise ValueError(f"keys per page {page_keys} (page_size x KV heads in a tile) must divide 64 or be a "
                         "multiple of it")
    if smem_bytes(pages, rows, keys) > SMEM_BYTES:
        raise ValueError(f"a {keys}-key tile of head_dim {dh} needs {smem_bytes(pages, rows, keys)} bytes of SMEM")
    if pages.format != "dense" and (page_keys // chunks) % 32:
        # a TMA copy moves a multiple of 128 bytes: one page's scales, in f32 if need be (`scale_dtype`)
        raise ValueError(f"page_size * kv_heads = {page_keys} must be a multiple of 32 for {pages.format} pages")


def scale_dtype(pages: KernelPages, keys_per_copy: int):
    """The dtype the kernel reads int8 / fp8 scales in: as stored when one page's (chunk's) row of
    them is a multiple of 128 bytes (a TMA copy's unit: 64 bf16 scales, e.g. 16 tokens x 4 KV
    heads), else f32, converted per call (a pass over the scale pool)."""
    stored = jnp.dtype(pages.k_scale.dtype)
    return stored if keys_per_copy * stored.itemsize % 128 == 0 else jnp.dtype(jnp.float32)


def query_rows(q_heads: int, decode: bool) -> int:
    """Rows of a program's query tile: decode, the query heads padded to 64; prefill, 64 (128
    past 64 heads) holding rows / Hq queries of all heads."""
    if decode:
        return ROWS * cdiv(q_heads, ROWS)
    if q_heads > 2 * ROWS:
        raise ValueError(f"the Mosaic GPU prefill kernel takes up to {2 * ROWS} query heads, not {q_heads}")
    return ROWS if q_heads <= ROWS else 2 * ROWS


def mgpu_supports(pages: KernelPages, q_heads: int, *, decode: bool) -> bool:
    """Do the Mosaic GPU kernels take these pages and heads? (The dispatch asks for prefill on
    Hopper, KIVI pages aside: unverified on a device, they go to Triton.)"""
    per_head = not decode and pages.format == "dense" and pages.num_kv_heads > 1  # chunked_prefill_mgpu's choice
    try:
        check_mgpu_shapes(pages, query_rows(q_heads // pages.num_kv_heads if per_head else q_heads, decode), per_head)
    except ValueError:
        return False
    return True


def compute_dtype(pages: KernelPages):
    """The wgmma operand dtype: the pages' own for dense, bf16 for int8 (exact) and KIVI (codes
    exact, keys dequantized as the reference's bf16), f16 for fp8 (Hopper converts fp8 to f16
    in hardware, not to bf16; both fp8 ranges fit f16)."""
    return {"dense": pages.k.dtype, "int8": jnp.bfloat16, "int4": jnp.bfloat16,
            "int2": jnp.bfloat16}.get(pages.format, jnp.float16)


def _swizzled(shape, dtype, max_row_bytes: int = 128) -> plgpu.SMEM:
    """SMEM in 8-row tiles of up to `max_row_bytes` (128) bytes per row, swizzled: what TMA and
    wgmma want. Rows under 32 bytes (int2 codes at head_dim 64, never a wgmma operand) stay
    plain: no swizzle that narrow exists."""
    row_bytes = min(128, max_row_bytes, shape[-1] * jnp.dtype(dtype).itemsize)
    if row_bytes < 32:
        return plgpu.SMEM(shape, dtype)
    tiling = plgpu.TilingTransform((8, row_bytes // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(row_bytes)))


def _kernel(lengths_ref, q_lo_ref, q_hi_ref, bt_ref, row_pos_ref, slots_ref, q_ref, k_ref, v_ref, *refs,
            cfg: MgpuTiles):
    """One program: grid point (b, block, split). GMEM refs (w = Dh / parts; KIVI packs `parts`
    channels in a byte, other formats have one part)::

        lengths i32[B]; q_lo, q_hi i32[B, blocks]; block tables i32[B, max_pages]
        row_pos i32[B, blocks, rows] (-1: padding); slots i32[B] (KIVI: the row's tail)
        q [B, blocks, parts, rows, w] (compute dtype): query channels split as the parts are
        k, v    [P, chunks, S * Hkv / chunks, w] (per-head: [P, chunks, S / chunks, Hkv, Dh])
        int8 / fp8: k_scale, v_scale [P, chunks, S * Hkv / chunks]
        KIVI: k_scale, k_zero bf16[P, Hkv, Dh]; v_scale, v_zero [P, chunks, S * Hkv / chunks];
              k_tail, v_tail bf16[M, chunks, S * Hkv / chunks, parts, w]
        -> acc f32[splits, B, blocks, parts, rows, w], m, l f32[splits, B, blocks, rows]
    """
    n_scales = {"dense": 0, "kivi": 4}.get(cfg.kind, 2)
    scale_refs, refs = refs[:n_scales], refs[n_scales:]
    tail_refs, refs = (refs[:2], refs[2:]) if cfg.kind == "kivi" else ((), refs)
    acc_out, m_out, l_out, *scratch = refs
    # SMEM: q [parts, rows, w], row positions [rows], K/V stages [2, N, w], scale stages,
    # p [rows, N], barriers; quantized formats add the converted K/V tiles ([N, Dh]; KIVI [parts, N, w])
    q_smem, row_pos_smem, k_stage, v_stage, *scratch = scratch
    scale_stages, (p_smem, q_bar, kv_bars, tail_bar, *converted) = scratch[:n_scales], scratch[n_scales:]
    cast = (lambda x, layout: x) if cfg.interpret else plgpu.layout_cast  # interpret mode has no layouts
    b, block, split = lax.axis_index("b"), lax.axis_index("j"), lax.axis_index("s")
    length, q_lo, q_hi = lengths_ref[b], q_lo_ref[b, block], q_hi_ref[b, block]
    sched = page_schedule(length, q_lo, q_hi, cfg.page_size, cfg.opts)
    start = split * cfg.steps_per_split
    # KIVI: the schedule's last step, the current page, is read from the slot's tail, by the split that owns it
    tail_step = sched.count - 1
    has_tail = tail_scheduled(sched, length, cfg.page_size) if cfg.kind == "kivi" else jnp.bool_(False)
    stop = jnp.minimum(start + cfg.steps_per_split, sched.count - has_tail.astype(jnp.int32))
    tail_here = has_tail & (start <= tail_step) & (tail_step < start + cfg.steps_per_split)
    ppb, chunks, n = cfg.pages_per_step, cfg.chunks, cfg.keys
    page_rows = cfg.page_size * cfg.tile_heads // chunks  # rows of one TMA copy
    page_tokens = page_rows // cfg.tile_heads
    head = block // cfg.head_blocks  # per-head programs: their KV head
    tiles = cdiv(jnp.maximum(stop - start, 0), ppb) * chunks  # pool tiles this split folds in

    def tile_pages(t):
        """Schedule steps of tile t's pages (past `stop`: re-read the last page, masked) and its chunk."""
        first = start + (t // chunks) * ppb
        steps = [jnp.minimum(first + i, stop - 1) for i in range(ppb)]
        real = [first + i < stop for i in range(ppb)]
        return steps, real, t % chunks

    def tile_bases(t):
        """Cache position of the first key of each of tile t's pages (chunk), and which are read."""
        steps, real, chunk = tile_pages(t)
        return [sched.logical_page(step) * cfg.page_size + chunk * page_tokens for step in steps], real

    def fetch(t, slot):
        steps, _, chunk = tile_pages(t)
        bar = kv_bars.at[slot]
        for i, step in enumerate(steps):
            page = bt_ref[b, sched.logical_page(step)]
            rows = pl.ds(i * page_rows, page_rows)
            src = (page, chunk) if cfg.tile_heads == cfg.kv_heads else (page, chunk, slice(None), head)
            plgpu.copy_gmem_to_smem(k_ref.at[src], k_stage.at[slot, rows], bar)
            plgpu.copy_gmem_to_smem(v_ref.at[src], v_stage.at[slot, rows], bar)
            if cfg.kind == "kivi":  # a page's key scales and zeros: one [Hkv, Dh] row block per page, every chunk
                k_scale_ref, k_zero_ref, v_scale_ref, v_zero_ref = scale_refs
                k_scales, k_zeros, v_scales, v_zeros = scale_stages
                heads = pl.ds(i * cfg.kv_heads, cfg.kv_heads)
                plgpu.copy_gmem_to_smem(k_scale_ref.at[page], k_scales.at[slot, heads], bar)
                plgpu.copy_gmem_to_smem(k_zero_ref.at[page], k_zeros.at[slot, heads], bar)
                plgpu.copy_gmem_to_smem(v_scale_ref.at[page, chunk], v_scales.at[slot, rows], bar)
                plgpu.copy_gmem_to_smem(v_zero_ref.at[page, chunk], v_zeros.at[slot, rows], bar)
            elif cfg.quantized:
                for ref, stage in zip(scale_refs, scale_stages):
                    plgpu.copy_gmem_to_smem(ref.at[page, chunk], stage.at[slot, rows], bar)

    def key_positions(bases, real, col):
        """Cache position of key column `col` (i32, col's shape) of a tile whose pages start at
        `bases`, and whether it is read (its page is `real` and it lies before the length)."""
        token = col // cfg.tile_heads  # token within the tile
        pos = jnp.zeros_like(col)
        ok = jnp.zeros(col.shape, jnp.bool_)
        for i, (base, is_real) in enumerate(zip(bases, real)):
            here = (token // page_tokens) == i
            pos = jnp.where(here, base + token % page_tokens, pos)
            ok = ok | (here & is_real)
        return pos, ok & (pos < length)

    def convert(slot, bases, real):
        """Stage `slot` of a tile whose pages start at `bases` -> (K tiles, V tiles: `parts` SMEM
        refs [N, w] the wgmmas read; per-key score scales, SMEM [N] or None; (per-key value
        scales, value zeros), SMEM [N] or None)."""
        if cfg.kind == "kivi":
            return convert_kivi(slot)
        _, v_ok = key_positions(bases, real, _iota((n, cfg.head_dim), 0, cfg))  # bool[N, Dh]: V rows read
        k_src, v_src = k_stage.at[slot], v_stage.at[slot]
        if cfg.quantized:  # convert into the tiles the wgmmas read
            k_src, v_src = converted
            k_src[...] = k_stage[slot].astype(k_src.dtype)
        v = v_stage[slot].astype(v_src.dtype)
        v_src[...] = jnp.where(v_ok, v, jnp.zeros_like(v))  # p is 0 there, but 0 * NaN is not
        k_cols, v_cols = (None, None) if not cfg.quantized else (scale_stages[0].at[slot], scale_stages[1].at[slot])
        return [k_src], [v_src], k_cols, (v_cols, None)

    def convert_kivi(slot):
        """KIVI: K part j = zero + code * scale per (page, head) and channel, built here in f32 (the
        scales vary along both axes of the tile, so they cannot ride on the scores' columns); V
        parts are the codes (exact in bf16, never NaN: no rows to zero): the per-token scale and
        zero act on p's columns."""
        k_parts, v_parts = converted
        k_scales, k_zeros, v_scales, v_zeros = scale_stages
        w, bits = cfg.head_dim // cfg.parts, 8 // cfg.parts
        row = _iota((n, w), 0, cfg)
        group = (row // page_rows) * cfg.kv_heads + row % cfg.kv_heads  # i32[N, w]: the key's (page, head) row
        # i32[N, w]: the packed bytes, widened (Mosaic GPU does no arithmetic on 8-bit registers)
        k_codes, v_codes = (_load(stage.at[slot], cfg).astype(jnp.int32) for stage in (k_stage, v_stage))
        for j in range(cfg.parts):
            channels = pl.ds(j * w, w)
            scale = zero = jnp.zeros((n, w), jnp.float32)
            for g in range(ppb * cfg.kv_heads):  # row selects: a tile holds few (page, head) rows
                scale = jnp.where(group == g, _columns(k_scales.at[slot, g, channels], (n, w), cfg), scale)
                zero = jnp.where(group == g, _columns(k_zeros.at[slot, g, channels], (n, w), cfg), zero)
            codes = ((k_codes >> (j * bits)) & (2**bits - 1)).astype(jnp.float32)  # f32[N, w]
            k_parts[j] = (zero + codes * scale).astype(k_parts.dtype)
            v_parts[j] = ((v_codes >> (j * bits)) & (2**bits - 1)).astype(v_parts.dtype)
        parts = lambda ref: [ref.at[j] for j in range(cfg.parts)]
        return parts(k_parts), parts(v_parts), None, (v_scales.at[slot], v_zeros.at[slot])

    def attend(carry, bases, real, k_tiles, v_tiles, k_cols, v_cols):
        """Fold one tile into the carry (acc: `parts` arrays f32[rows, w]; m, l f32[rows]).
        k_tiles / v_tiles: `parts` SMEM refs [N, w]; k_cols: per-key score scales (SMEM [N]) or
        None; v_cols: (per-key value scales, zeros) or Nones."""
        acc, m, l = carry

        def qk(acc_ref):
            for j, k_tile in enumerate(k_tiles):  # scores add up over channel parts
                plgpu.wgmma(acc_ref, q_smem.at[j], plgpu.transpose_ref(k_tile, (1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((cfg.rows, n), jnp.float32))
        row, col = _iota((cfg.rows, n), 0, cfg), _iota((cfg.rows, n), 1, cfg)
        key_pos, key_ok = key_positions(bases, real, col)
        if k_cols is not None:  # per-token key scale: a column scale of the scores
            s = s * _columns(k_cols, s.shape, cfg)
        vis = key_ok & visible(key_pos, lax.broadcast_in_dim(row_pos, s.shape, [0]), length, cfg.opts)
        if cfg.tile_heads > 1:  # row r reads only its query head's KV head's columns
            vis = vis & ((row % cfg.q_heads) // cfg.group == col % cfg.tile_heads)
        s = jnp.where(vis, cap_scores(s * cfg.scale, cfg.opts.soft_cap), MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l = l * correction + p.sum(axis=1)
        v_scales, v_zeros = v_cols
        # per-token value zero: sum_n p[r, n] * zero[n], the same in every channel (unread zeros may be NaN)
        zero_term = None if v_zeros is None else jnp.where(vis, p * _columns(v_zeros, p.shape, cfg), 0.0).sum(axis=1)
        if v_scales is not None:  # per-token value scale: a column scale of the probabilities
            p = jnp.where(vis, p * _columns(v_scales, p.shape, cfg), 0.0)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv(v_tile):
            def product(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_tile)
                return acc_ref[...]
            return pl.run_scoped(product, plgpu.ACC((cfg.rows, cfg.head_dim // cfg.parts), jnp.float32))

        acc = [a * lax.broadcast_in_dim(correction, a.shape, [0]) + pv(v_tile) for a, v_tile in zip(acc, v_tiles)]
        if zero_term is not None:
            acc = [a + lax.broadcast_in_dim(zero_term, a.shape, [0]) for a in acc]
        return acc, m_new, l

    for j in range(cfg.parts):  # a copy per part: TMA strides up to 5 dimensions ([parts, rows, w] tiled has 6)
        plgpu.copy_gmem_to_smem(q_ref.at[b, block, j], q_smem.at[j], q_bar)
    plgpu.copy_gmem_to_smem(row_pos_ref.at[b, block], row_pos_smem, q_bar)

    @pl.when(tiles > 0)
    def _():
        fetch(0, 0)

    plgpu.barrier_wait(q_bar)
    row_pos = row_pos_smem[...] if cfg.interpret else plgpu.load(  # i32[rows]: cache position of row r's query
        row_pos_smem, (), layout=plgpu.Layout.WGMMA.reduce(1))

    def body(t, carry):
        slot = t % 2

        @pl.when(t + 1 < tiles)
        def _():
            fetch(t + 1, 1 - slot)

        plgpu.barrier_wait(kv_bars.at[slot])
        bases, real = tile_bases(t)
        k_tiles, v_tiles, k_cols, v_cols = convert(slot, bases, real)
        plgpu.commit_smem()
        return attend(carry, bases, real, k_tiles, v_tiles, k_cols, v_cols)

    def tail_body(chunk, carry):
        """KIVI: chunk `chunk` of the current page, from the slot's bf16 tail straight into the
        converted tiles' first rows (the pool walk is done with them); the rest of the tile is masked."""
        k_parts, v_parts = converted
        k_tail_ref, v_tail_ref = tail_refs
        rows = pl.ds(0, page_rows)
        plgpu.commit_smem()  # the pool tiles' generic writes before TMA overwrites them
        for j in range(cfg.parts):
            plgpu.copy_gmem_to_smem(k_tail_ref.at[slots_ref[b], chunk, :, j], k_parts.at[j, rows], tail_bar)
            plgpu.copy_gmem_to_smem(v_tail_ref.at[slots_ref[b], chunk, :, j], v_parts.at[j, rows], tail_bar)
        plgpu.barrier_wait(tail_bar)
        bases = [(length // cfg.page_size) * cfg.page_size + chunk * page_tokens] * ppb
        real = [True] + [False] * (ppb - 1)
        _, v_ok = key_positions(bases, real, _iota((n, cfg.head_dim // cfg.parts), 0, cfg))  # bool[N, w]
        for j in range(cfg.parts):  # tail tokens past the length, and rows of other tiles: 0 (may be NaN)
            v = v_parts[j]
            v_parts[j] = jnp.where(v_ok, v, jnp.zeros_like(v))
        plgpu.commit_smem()
        parts = [k_parts.at[j] for j in range(cfg.parts)], [v_parts.at[j] for j in range(cfg.parts)]
        return attend(carry, bases, real, *parts, None, (None, None))

    wgmma, row_vector = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
    carry = ([cast(jnp.full((cfg.rows, cfg.head_dim // cfg.parts), 0.0, jnp.float32), wgmma)
              for _ in range(cfg.parts)],
             cast(jnp.full((cfg.rows,), MASK_VALUE, jnp.float32), row_vector),
             cast(jnp.full((cfg.rows,), 0.0, jnp.float32), row_vector))
    carry = lax.fori_loop(0, tiles, body, carry)
    if cfg.kind == "kivi":
        carry = lax.fori_loop(0, jnp.where(tail_here, chunks, 0), tail_body, carry)
    acc, m, l = carry
    for j, a in enumerate(acc):  # registers -> GMEM: no SMEM left over for a staged copy at head_dim 256
        acc_out[split, b, block, j] = a
    m_out[split, b, block] = m
    l_out[split, b, block] = l


def _iota(shape, dim: int, cfg: MgpuTiles) -> jax.Array:
    """i32 iota in the wgmma register layout (plain in interpret mode, which has no layouts)."""
    if cfg.interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _load(ref, cfg: MgpuTiles) -> jax.Array:
    """A whole SMEM tile in the wgmma register layout (plain in interpret mode)."""
    return ref[...] if cfg.interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)


def _columns(scales_ref, shape, cfg: MgpuTiles) -> jax.Array:
    """Per-column values (SMEM [N]) -> f32 broadcast over the rows of a [rows, N] tile."""
    if cfg.interpret:
        scales = scales_ref[...]
    else:  # loaded straight into the layout of a row of wgmma's result
        scales = plgpu.load(scales_ref, (), layout=plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(scales.astype(jnp.float32), shape, [1])


def _attend(q_rows, row_pos, q_lo, q_hi, pages: KernelPages, block_tables, lengths, slots, *, q_heads: int,
            splits: int, steps_per_split: int, scale: float, opts: AttentionOptions, interpret: bool,
            per_head: bool = False):
    """Run the kernel over query row blocks -> partials (m, l f32[splits, B, blocks, rows, 1], acc
    f32[..., rows, Dh]). q_rows [B, blocks, rows, Dh] (row r: query head r % q_heads; `per_head`:
    block j holds queries of KV head j // (blocks / Hkv) only), row_pos i32[B, blocks, rows]
    (-1: padding, sees nothing), q_lo / q_hi i32[B, blocks], slots i32[B] (KIVI tails)."""
    b, blocks, rows, dh = q_rows.shape
    hkv, page_size, parts = pages.num_kv_heads, pages.page_size, pages.parts
    w = dh // parts  # channels of a part
    ppb, chunks = tiles_for(pages, rows, per_head)
    tile_heads = 1 if per_head else hkv
    cfg = MgpuTiles(pages.format, page_size, hkv, q_heads, q_heads // hkv, rows, dh, tile_heads,
                    blocks // hkv if per_head else blocks, ppb, chunks, steps_per_split, opts, scale, interpret)
    n, dtype, stored = cfg.keys, compute_dtype(pages), pages.k.dtype
    page_rows = page_size * hkv // chunks
    # [P, S, Hkv, ...] -> [P, chunks, S * Hkv / chunks, ...]: a TMA copy takes one (page, chunk);
    # per-head programs: [P, chunks, S / chunks, Hkv, Dh], a copy takes one head's (page, chunk)
    flat = lambda a: a.reshape(a.shape[0], chunks, page_rows, *a.shape[3:])
    if per_head:
        flat = lambda a: a.reshape(a.shape[0], chunks, page_size // chunks, *a.shape[2:])
    operands = [flat(pages.k), flat(pages.v)]
    scales = scale_dtype(pages, page_rows) if cfg.quantized else jnp.float32
    # KIVI: key scales / zeros as stored ([P, Hkv, Dh] bf16); tails in channel parts, in bf16 (TMA
    # copies bytes: an f32 tail is converted per call, one page per slot)
    if cfg.kind == "kivi":
        tail = lambda a: a.astype(dtype).reshape(a.shape[0], chunks, page_rows, parts, w)
        operands += [pages.k_scale, pages.k_zero, flat(pages.v_scale.astype(scales)),
                     flat(pages.v_zero.astype(scales)), tail(pages.k_tail), tail(pages.v_tail)]
    elif cfg.quantized:
        operands += [flat(pages.k_scale.astype(scales)), flat(pages.v_scale.astype(scales))]
    scale_stages = []  # double-buffered like the K/V stages
    if cfg.kind == "kivi":  # key scales, key zeros: [Hkv, Dh] rows of each page; value scales, zeros [N]
        scale_stages = [plgpu.SMEM((2, ppb * hkv, dh), pages.k_scale.dtype)] * 2 + [plgpu.SMEM((2, n), scales)] * 2
    elif cfg.quantized:  # key, value scales [N]
        scale_stages = [plgpu.SMEM((2, n), scales)] * 2
    scratch = [
        _swizzled((parts, rows, w), dtype), plgpu.SMEM((rows,), jnp.int32),  # q, row positions
        _swizzled((2, n, w), stored), _swizzled((2, n, w), stored),  # k, v stages
        *scale_stages,
        # p; its swizzle must be the V tile's (a wgmma's operands share one): narrower for KIVI parts under 64 channels
        _swizzled((rows, n), dtype, w * jnp.dtype(dtype).itemsize),
        plgpu.Barrier(num_arrivals=parts + 1),  # q parts, row positions
        plgpu.Barrier(num_arrivals=ppb * (2 + len(scale_stages)), num_barriers=2),
        plgpu.Barrier(num_arrivals=2 * parts),  # a KIVI tail chunk's K and V parts (unused by other formats)
    ]
    if cfg.kind == "kivi":  # k, v parts the wgmmas read
        scratch += [_swizzled((parts, n, w), dtype), _swizzled((parts, n, w), dtype)]
    elif cfg.quantized:  # k, v tiles the wgmmas read
        scratch += [_swizzled((n, dh), dtype), _swizzled((n, dh), dtype)]

    def paged_attention_mgpu_kernel(*refs):  # the name a compile error shows
        _kernel(*refs, cfg=cfg)

    f32 = jnp.float32
    kernel = plgpu.kernel(
        paged_attention_mgpu_kernel,
        out_type=(jax.ShapeDtypeStruct((splits, b, blocks, parts, rows, w), f32),
                  jax.ShapeDtypeStruct((splits, b, blocks, rows), f32),
                  jax.ShapeDtypeStruct((splits, b, blocks, rows), f32)),
        grid=(b, blocks, splits), grid_names=("b", "j", "s"), scratch_types=scratch,
        interpret=mgpu_interpret.install() if interpret else None,
    )
    q_parts = q_rows.astype(dtype).reshape(b, blocks, rows, parts, w).swapaxes(2, 3)  # part j: channels [j*w, (j+1)*w)
    acc, m, l = kernel(lengths.astype(jnp.int32), q_lo, q_hi, block_tables.astype(jnp.int32), row_pos,
                       slots.astype(jnp.int32), q_parts, *operands)
    acc = acc.swapaxes(3, 4).reshape(splits, b, blocks, rows, dh)
    return m[..., None], l[..., None], acc


def default_splits(batch: int, steps: int, pages_per_tile: int) -> int:
    """Key-axis splits: about 2 programs per SM of an H100 (132 SMs), each folding at least 8
    tiles, so the partials (f32 [rows, Dh] per split) stay small beside the pages read."""
    return max(1, min(cdiv(steps, 8 * pages_per_tile), cdiv(132 * 2, batch)))


def _finish(m, l, acc, sink_logits, row_heads: jax.Array) -> jax.Array:
    """Merge the splits, add the sink logits (row_heads: i32[blocks, rows], each row's query
    head) -> f32[B, blocks, rows, Dh]."""
    m, l, acc = merge_partials(m, l, acc)
    sink = None
    if sink_logits is not None:
        sink = jnp.broadcast_to(sink_logits.astype(jnp.float32)[row_heads][..., None], (*acc.shape[:-1], 1))
    return finalize(m, l, acc, sink)


@functools.partial(jax.jit, static_argnames=("scale", "opts", "k_splits", "interpret"))
def paged_decode_mgpu(
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
    k_splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention through block tables -> [B, Hq, Dh]: the contract of `paged_decode_gpu`
    (`slots`: each row's cache slot, whose tail holds a KIVI sequence's current page; required
    for KIVI pages, else default arange(B)). Rows are the query heads; the key axis is split over `k_splits` programs
    (flash-decoding). `interpret=True` runs jax's GPU interpreter on CPU."""
    b, hq, dh = q.shape
    slots = pages.row_slots(slots, b)
    query_pos = lengths - 1 if query_pos is None else query_pos
    pages.validate()
    check_decode_shapes(q, pages, block_tables, lengths, query_pos)
    check_sink_logits(sink_logits, hq)
    rows = query_rows(hq, decode=True)
    check_mgpu_shapes(pages, rows)
    ppb, _ = tiles_for(pages, rows)
    steps = decode_steps(block_tables.shape[1], pages.page_size, opts)
    splits = k_splits or default_splits(b, steps, ppb)
    query_pos = query_pos.astype(jnp.int32)
    row_pos = jnp.where(jnp.arange(rows) < hq, query_pos[:, None], -1)[:, None]  # [B, 1, rows]
    q_rows = jnp.pad(q, ((0, 0), (0, rows - hq), (0, 0)))[:, None]  # [B, 1, rows, Dh]
    partials = _attend(q_rows, row_pos, query_pos[:, None], query_pos[:, None], pages, block_tables, lengths, slots,
                       q_heads=hq, splits=splits, steps_per_split=cdiv(cdiv(steps, splits), ppb) * ppb,
                       scale=scale, opts=opts, interpret=interpret)
    return _finish(*partials, sink_logits, jnp.arange(rows)[None] % hq)[:, 0, :hq].astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "opts", "interpret"))
def chunked_prefill_mgpu(
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
    interpret: bool = False,
) -> jax.Array:
    """A chunk of queries through block tables -> [B, T, Hq, Dh]: the contract of
    `chunked_prefill_gpu`. Dense pages: a program owns one KV head and block_q = 64 / G of its
    queries x the G query heads reading it (row r = t * G + g; 128 rows past G = 64), so the
    tensor cores work on that head's keys only. int8 / fp8 / KIVI pages: a program owns all heads
    (their scales are one row per page) and block_q = 64 / Hq queries (row r = t * Hq + h).
    `slots`: each row's cache slot (KIVI tails: required; other formats: default arange(B))."""
    b, t, hq, dh = q.shape
    slots = pages.row_slots(slots, b)
    pages.validate()
    check_prefill_shapes(q, pages, block_tables, lengths, query_pos)
    check_sink_logits(sink_logits, hq)
    hkv = pages.num_kv_heads
    per_head = pages.format == "dense" and hkv > 1  # (one KV head: the same programs either way)
    heads = hq // hkv if per_head else hq  # query heads in a block's rows
    rows = query_rows(heads, decode=False)
    check_mgpu_shapes(pages, rows, per_head)
    ppb, _ = tiles_for(pages, rows, per_head)
    block_q = rows // heads
    blocks = cdiv(t, block_q)
    pad_t = blocks * block_q - t
    pos, q_lo, q_hi = query_blocks(query_pos, blocks * block_q, block_q)  # i32[B, blocks, block_q], [B, blocks]
    row_pad = ((0, 0), (0, 0), (0, rows - block_q * heads))
    row_pos = jnp.pad(jnp.repeat(pos, heads, axis=2), row_pad, constant_values=-1)  # [B, blocks, rows]
    q = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    row_heads = jnp.arange(rows) % heads  # [rows]: a row's query head (within its KV head's group)
    if per_head:  # blocks j = h * blocks + i: query block i of KV head h
        q_rows = q.reshape(b, blocks, block_q, hkv, heads, dh).transpose(0, 3, 1, 2, 4, 5)
        q_rows = q_rows.reshape(b, hkv * blocks, block_q * heads, dh)
        row_pos, q_lo, q_hi = (jnp.tile(a, (1, hkv) + (1,) * (a.ndim - 2)) for a in (row_pos, q_lo, q_hi))
        row_heads = (jnp.arange(hkv)[:, None, None] * heads + row_heads).repeat(blocks, axis=1).reshape(-1, rows)
    else:
        q_rows = q.reshape(b, blocks, block_q * hq, dh)
        row_heads = row_heads[None]
    q_rows = jnp.pad(q_rows, (*row_pad, (0, 0)))
    partials = _attend(q_rows, row_pos, q_lo, q_hi, pages, block_tables, lengths, slots, q_heads=hq, splits=1,
                       steps_per_split=cdiv(block_tables.shape[1], ppb) * ppb, scale=scale, opts=opts,
                       interpret=interpret, per_head=per_head)
    out = _finish(*partials, sink_logits, row_heads)[:, :, :block_q * heads]  # [B, blocks', block_q * heads, Dh]
    if per_head:
        out = out.reshape(b, hkv, blocks, block_q, heads, dh).transpose(0, 2, 3, 1, 4, 5)
    return out.reshape(b, blocks * block_q, hq, dh)[:, :t].astype(q.dtype)
