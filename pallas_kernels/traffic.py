"""Bytes a decode kernel moves per decoded token, against the bytes the cache must supply.

TPU (`paged_decode_tpu`): counted from the kernel's own page walk. Every page slot's index map
is `tpu_tiles.Walk.physical_page`; evaluated here over the whole grid (b-major, as the Pallas
pipeline runs it), a slot fetches its block whenever the block index differs from the slot's
previous step (Pallas skips the copy of an unchanged block), plus each sequence's KIVI tail,
query and output blocks.

GPU (`paged_decode_gpu`): the Triton kernel reads K/V with masked loads (a masked element is
not read), so it moves the visible tokens of each head, their scales, a KIVI page's key
scales once per page read, the tail's tokens, the query rows, the block-table entries, and
writes and re-reads the split-K partials (f32 [rows, D] per program: the query heads of up to
16 / G_pad KV heads packed into 16 rows). A model of those loads (DRAM sector granularity
ignored), not a measurement.

GPU on Hopper (`paged_decode_mgpu`): counted from its walk (the splits' schedule steps, whole
pages of every head per TMA copy, a tile's unused page slots re-reading the split's last page),
plus the per-call conversion of the int8 / fp8 scale pool to f32, the query rows and row
positions, and the split-K partials written and merged.

The cache must supply, per sequence: its visible tokens (all of them, or the window and the
sinks) at `jaxinfer.kv.formats` bytes_per_token, KIVI's current-page tokens from the bf16 tail.

    python -m pallas_kernels.traffic       # the table in BENCHMARKS.md
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tpu_tiles
from pallas_kernels.common import AttentionOptions, cdiv, decode_steps, page_schedule
from pallas_kernels.lowering import OPTIONS, MlaShape, Shape, abstract_pages

FORMAT_NAMES = {"dense": "bf16"}  # KernelPages' "dense" at bf16 is jaxinfer.kv's "bf16"


@dataclasses.dataclass(frozen=True)
class Traffic:
    moved: float  # bytes the kernel reads and writes for the whole batch
    cache: float  # bytes the cache must supply for the whole batch
    tokens: int  # decoded tokens (the batch)
    grid_steps: int  # TPU: grid steps; GPU: programs
    dmas: int  # TPU: page-block copies issued; GPU: 0

    @property
    def ratio(self) -> float:
        return self.moved / self.cache


def visible_tokens(length: int, opts: AttentionOptions) -> int:
    """Keys a decode query at position length - 1 sees."""
    if opts.window is None:
        return length
    return min(length, opts.window) + min(opts.num_sinks, max(length - opts.window, 0))


def cache_bytes(fmt: str, shape: Shape, lengths, opts: AttentionOptions) -> float:
    from jaxinfer.kv import formats as F

    f = F.get_format(FORMAT_NAMES.get(fmt, fmt))
    per_token = f.bytes_per_token(shape.kv_heads, shape.head_dim, shape.page_size)
    total = 0.0
    for n in lengths:
        seen = visible_tokens(int(n), opts)
        tail = int(n) % shape.page_size if f.has_tail else 0
        total += (seen - tail) * per_token + tail * 2 * shape.kv_heads * shape.head_dim * 2  # tail: bf16 K and V
    return total


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def tpu_decode(fmt: str, shape: Shape, lengths, opts: AttentionOptions = AttentionOptions(),
               pages_per_block: int | None = None) -> Traffic:
    """Traffic of `paged_decode_tpu` for sequences of `lengths` tokens (block tables: distinct pages)."""
    pages = abstract_pages(fmt, shape)
    cfg = tpu_tiles.TpuConfig.of(pages, max_pages=shape.max_pages, opts=opts, scale=1.0,
                                 pages_per_block=pages_per_block, steps=decode_steps(shape.max_pages, shape.page_size, opts))
    copies = tpu_page_copies(cfg, lengths, shape.batch)
    page_bytes = sum(_nbytes(a.shape[1:], a.dtype) for a in (*pages.k_parts(), *pages.v_parts()))
    per_sequence = 2 * _nbytes((shape.q_heads, shape.head_dim), jnp.bfloat16)  # q in, output out
    if pages.k_tail is not None:
        per_sequence += 2 * _nbytes(pages.k_tail.shape[1:], pages.k_tail.dtype)
    moved = copies * page_bytes + shape.batch * per_sequence
    return Traffic(moved, cache_bytes(fmt, shape, np.asarray(lengths), opts), shape.batch,
                   shape.batch * cfg.num_blocks, copies)


def tpu_page_copies(cfg: tpu_tiles.TpuConfig, lengths, batch: int) -> int:
    """Page-block copies of a TPU decode walk over `batch` sequences of `lengths` (block tables:
    distinct pages): each slot's index map over the grid, b-major, a copy whenever it changes."""
    lengths = jnp.asarray(lengths, jnp.int32)
    tables = jnp.arange(1, 1 + batch * cfg.max_pages, dtype=jnp.int32)  # flattened [B, max_pages]

    def page(b, i, slot):
        walk = tpu_tiles.Walk(lengths[b], lengths[b] - 1, lengths[b] - 1, cfg)
        return walk.physical_page(tables, b, i, slot, cfg)

    grid_b, grid_i = jnp.meshgrid(jnp.arange(batch), jnp.arange(cfg.num_blocks), indexing="ij")
    ids = np.stack([np.asarray(jax.vmap(jax.vmap(lambda b, i: page(b, i, j)))(grid_b, grid_i)).reshape(-1)
                    for j in range(cfg.pages_per_block)])  # [ppb, B * num_blocks] in grid order
    return int(np.sum(ids[:, 1:] != ids[:, :-1]) + ids.shape[0])


def mla_decode(target: str, shape: MlaShape, lengths) -> Traffic:
    """Traffic of `mla_decode_tpu` (its page walk, as `tpu_decode`) or `mla_decode_gpu` (a model
    of its masked loads: every head block reads the sequence's tokens, plus split-K partials);
    the cache must supply each sequence's tokens once, (r + dr) bf16 numbers each."""
    from pallas_kernels.common import next_power_of_2
    from pallas_kernels.mla_decode_gpu import KEYS_PER_BLOCK, MAX_ROWS, MIN_ROWS, default_mla_splits

    lengths = np.asarray(lengths)
    h, r, dr, s = shape.heads, shape.rank, shape.rope_dim, shape.page_size
    token = _nbytes((r + dr,), jnp.bfloat16)
    cache = float(lengths.sum()) * token
    q_out = shape.batch * (_nbytes((h, r + dr), jnp.bfloat16) + _nbytes((h, r), jnp.float32))  # queries, output
    if target == "tpu":
        ppb = tpu_tiles.default_pages_per_block(s, shape.max_pages)
        cfg = tpu_tiles.TpuConfig("dense", (), (), 1, s, 1, shape.max_pages, ppb, False, AttentionOptions(), 1.0,
                                  shape.max_pages)
        copies = tpu_page_copies(cfg, lengths, shape.batch)
        return Traffic(copies * s * token + q_out, cache, shape.batch, shape.batch * cfg.num_blocks, copies)
    rows = min(MAX_ROWS, max(MIN_ROWS, next_power_of_2(h)))
    blocks = cdiv(h, rows)
    splits = default_mla_splits(shape.batch * blocks, shape.max_pages, max(1, KEYS_PER_BLOCK // s), s, rows, r, token)
    partials = shape.batch * blocks * splits * 2 * (rows * r + 2 * rows) * 4  # written, then read by the merge
    tables = 4 * sum(cdiv(int(n), s) for n in lengths) * blocks
    return Traffic(blocks * cache + tables + partials + q_out, cache, shape.batch, shape.batch * blocks * splits, 0)


def gpu_decode(fmt: str, shape: Shape, lengths, opts: AttentionOptions = AttentionOptions()) -> Traffic:
    """Traffic of `paged_decode_gpu` (its default pages_per_block and k_splits) as a model of its loads."""
    from pallas_kernels.gpu_tiles import default_pages_per_block, key_bytes
    from pallas_kernels.paged_decode_gpu import default_k_splits, packed_heads

    pages = abstract_pages(fmt, shape)
    h, d, s = shape.kv_heads, shape.head_dim, shape.page_size
    heads, rows = packed_heads(shape.q_heads // h, h)
    blocks = h // heads  # programs per sequence and split, each [rows, D]
    steps = decode_steps(shape.max_pages, s, opts)
    ppb = default_pages_per_block(s, steps, key_bytes(pages, heads, d))
    splits = default_k_splits(shape.batch * blocks, cdiv(steps, ppb))
    token_head = sum(_nbytes(a.shape[3:], a.dtype) for a in (pages.k, pages.v))  # one token, one head
    token_head += sum(_nbytes((), a.dtype) for a in (pages.v_scale, pages.v_zero) if a is not None)
    if not pages.is_kivi and pages.k_scale is not None:
        token_head += _nbytes((), pages.k_scale.dtype)
    moved = 0.0
    for n in np.asarray(lengths):
        seen = visible_tokens(int(n), opts)
        tail = int(n) % s if pages.is_kivi else 0
        pages_read = int(page_schedule(int(n), int(n) - 1, int(n) - 1, s, opts).count) - (1 if tail else 0)
        moved += h * (seen - tail) * token_head + h * tail * 2 * d * 2
        if pages.is_kivi:
            moved += h * pages_read * 2 * _nbytes((d,), pages.k_scale.dtype)  # key scale + zero per page
        moved += h * pages_read * 4  # block-table entries
        moved += blocks * (_nbytes((rows, d), jnp.bfloat16) + splits * 2 * (rows * d + 2 * rows) * 4)  # q, partials
        moved += _nbytes((shape.q_heads, d), jnp.bfloat16)  # output
    return Traffic(moved, cache_bytes(fmt, shape, np.asarray(lengths), opts), shape.batch,
                   shape.batch * blocks * splits, 0)


def mgpu_decode(fmt: str, shape: Shape, lengths, opts: AttentionOptions = AttentionOptions()) -> Traffic:
    """Traffic of `paged_decode_mgpu` (its default k_splits) for sequences of `lengths` tokens."""
    from pallas_kernels.paged_attention_mgpu import default_splits, query_rows, scale_dtype, tiles_for

    pages = abstract_pages(fmt, shape)
    s, d = shape.page_size, shape.head_dim
    rows = query_rows(shape.q_heads, decode=True)
    ppb, _ = tiles_for(pages, rows)
    steps = decode_steps(shape.max_pages, s, opts)
    splits = default_splits(shape.batch, steps, ppb)
    per_split = cdiv(cdiv(steps, splits), ppb) * ppb
    quantized = pages.k_scale is not None
    _, chunks = tiles_for(pages, rows)
    scale_bytes = jnp.dtype(scale_dtype(pages, s * shape.kv_heads // chunks)).itemsize if quantized else 0
    page_bytes = 2 * _nbytes(pages.k.shape[1:], pages.k.dtype) + 2 * s * shape.kv_heads * scale_bytes
    copies = 0
    for n in np.asarray(lengths):
        count = int(page_schedule(int(n), int(n) - 1, int(n) - 1, s, opts).count)
        for split in range(splits):
            copies += cdiv(max(min(per_split, count - split * per_split), 0), ppb) * ppb
    per_program = rows * d * 2 + rows * 4 + 2 * (rows * d + 2 * rows) * 4  # q, row positions, partials
    moved = copies * page_bytes + shape.batch * splits * per_program + shape.batch * _nbytes((shape.q_heads, d),
                                                                                             jnp.bfloat16)
    if quantized and scale_bytes == 4:  # the scale pool: bf16 read, f32 written, per call
        moved += 2 * pages.k_scale.size * (2 + 4)
    return Traffic(moved, cache_bytes(fmt, shape, np.asarray(lengths), opts), shape.batch, shape.batch * splits,
                   copies)


def main() -> None:
    shape = Shape(batch=16, q_heads=32, kv_heads=8, head_dim=128, page_size=16, context=8192)
    rng = np.random.default_rng(0)
    mixed = rng.integers(1, shape.context + 1, size=shape.batch)  # ragged batch, lengths 1..8k
    print("| kernel | format | lengths | options | pages/step | grid steps | page DMAs | moved / cache bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for fmt in ("dense", "int8", "int4"):
        for label, lengths in (("all 8k", np.full(shape.batch, shape.context)), ("ragged 1-8k", mixed)):
            for opts in (AttentionOptions(), OPTIONS):
                o = "window 1024 + sinks" if opts.window else "none"
                for ppb in (1, None):
                    t = tpu_decode(fmt, shape, lengths, opts, ppb)
                    print(f"| paged_decode_tpu | {FORMAT_NAMES.get(fmt, fmt)} | {label} | {o} | {ppb or 'default'} | "
                          f"{t.grid_steps} | {t.dmas} | {t.ratio:.3f} |")
                g = gpu_decode(fmt, shape, lengths, opts)
                print(f"| paged_decode_gpu | {FORMAT_NAMES.get(fmt, fmt)} | {label} | {o} | - | {g.grid_steps} | - | "
                      f"{g.ratio:.3f} |")
                if fmt != "int4":  # KIVI pages: Triton only
                    m = mgpu_decode(fmt, shape, lengths, opts)
                    print(f"| paged_decode_mgpu | {FORMAT_NAMES.get(fmt, fmt)} | {label} | {o} | "
                          f"{tiles_for_label(fmt, shape)} | {m.grid_steps} | {m.dmas} | {m.ratio:.3f} |")
    for heads in (16, 128):  # MLA latent decode, bf16 latent cache (r 512 + RoPE 64), page 16
        mla = MlaShape(batch=shape.batch, heads=heads, context=shape.context)
        for label, lengths in (("all 8k", np.full(shape.batch, shape.context)), ("ragged 1-8k", mixed)):
            for target in ("tpu", "gpu"):
                t = mla_decode(target, mla, lengths)
                steps = "default" if target == "tpu" else "-"
                print(f"| mla_decode_{target} ({heads} heads) | bf16 latent | {label} | none | {steps} | "
                      f"{t.grid_steps} | {t.dmas if target == 'tpu' else '-'} | {t.ratio:.3f} |")


def tiles_for_label(fmt: str, shape: Shape) -> str:
    from pallas_kernels.paged_attention_mgpu import query_rows, tiles_for

    ppb, chunks = tiles_for(abstract_pages(fmt, shape), query_rows(shape.q_heads, decode=True))
    return f"{ppb}" if chunks == 1 else f"1/{chunks}"


if __name__ == "__main__":
    main()
