"""MLA latent decode attention for GPU: absorbed queries against the paged latent cache, one Pallas kernel.

Lowering: **Pallas Triton** (the lowering of the other GPU kernels here, gpu_tiles.py's masked
gathers), chosen with `jax.experimental.pallas.triton.CompilerParams`.

Reference: `jaxinfer.attention.reference.mla_attention_reference(absorb=True)` with T = 1,
before its W_UV step (the caller applies W_UV to the latent output).

Absorbed MLA is an MQA with one "KV head" whose key is [c ; k_rope] and whose value is c, so a
program takes a block of `rows` query heads of one sequence (H padded to a power of two >= 16,
tl.dot's minimum, at most 64 as in FlashMLA: a [64, 512] f32 accumulator is what 8 warps'
registers hold) and reads each latent page once for all of them; DeepSeek-V3 at 8-way tensor
parallelism has 16 heads per device (one block), all 128 heads make 2 blocks that each read
the cache::

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

Grid (B, H_pad / rows, k_splits): split s of sequence b walks its share of the pages [0, cdiv(length, S)),
`pages_per_block` pages per step (masked gathers: keys past the length are not read), and
writes its (m, l, acc); the wrapper merges the splits (flash-decoding, common.merge_partials).
Splits aim at 256 programs but keep the f32 partials under a tenth of the cache bytes
(`default_mla_splits`: a latent accumulator is 512 wide).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_tiles
from pallas_kernels.common import (AttentionOptions, attend_tile, cdiv, check_mla_shapes, finalize, init_carry,
                                   merge_partials, next_power_of_2, page_schedule, visible)
from pallas_kernels.paged_decode_gpu import MIN_ROWS, check_triton_shapes, default_k_splits

MAX_ROWS = 64  # query heads per program
KEYS_PER_BLOCK = 64  # a [64, 512] bf16 latent tile per step (the paged kernels' 128 keys: 128 KiB of shared memory)


def _kernel(lengths_ref, bt_ref, q_latent_ref, q_rope_ref, c_ref, rope_ref, acc_ref, m_ref, l_ref, *,
            page_size: int, pages_per_block: int, max_pages: int, steps_per_split: int, scale: float):
    b, split = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    count = page_schedule(length, length - 1, length - 1, page_size, AttentionOptions()).count
    start = split * steps_per_split
    stop = jnp.minimum(start + steps_per_split, count)
    q = (q_latent_ref[...], q_rope_ref[...])

    def body(i, carry):
        logical = start + i * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)  # i32[ppb]
        in_block = logical < stop
        page_ids = plgpu.load(bt_ref.at[jnp.clip(logical, 0, max_pages - 1)], mask=in_block, other=0)
        key_pos = logical[:, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)[None, :]  # i32[ppb, S]
        ok = in_block[:, None] & visible(key_pos, length - 1, length, AttentionOptions())  # read only these keys
        n = pages_per_block * page_size
        c = gpu_tiles.masked_gather(c_ref, page_ids, ok).reshape(n, -1)  # [ppb * S, r]
        k_rope = gpu_tiles.masked_gather(rope_ref, page_ids, ok).reshape(n, -1)  # [ppb * S, dr]
        return attend_tile(carry, q, (c, k_rope), (c,), ok.reshape(1, n), ok.reshape(n, 1), scale=scale,
                           soft_cap=None)

    num_blocks = jnp.maximum(stop - start + pages_per_block - 1, 0) // pages_per_block
    carry = jax.lax.fori_loop(0, num_blocks, body, init_carry(q[0].shape[0], q[0].shape[1]))
    acc_ref[...] = carry.acc[0]
    m_ref[...] = carry.m.reshape(-1)
    l_ref[...] = carry.l.reshape(-1)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "k_splits", "interpret", "num_warps",
                                             "num_stages"))
def mla_decode_gpu(
    q_latent: jax.Array,
    q_rope: jax.Array,
    c_kv: jax.Array,
    k_rope: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    pages_per_block: int | None = None,
    k_splits: int | None = None,
    interpret: bool = False,
    num_warps: int = 8,
    num_stages: int = 2,
) -> jax.Array:
    """Absorbed MLA decode through block tables -> f32[B, H, r] (see the module docstring)."""
    check_mla_shapes(q_latent, q_rope, c_kv, k_rope, block_tables, lengths)
    b, h, r = q_latent.shape
    dr, page_size, max_pages = q_rope.shape[-1], c_kv.shape[1], block_tables.shape[1]
    ppb = pages_per_block or max(1, KEYS_PER_BLOCK // page_size)  # a power of two: pages past the walk are masked
    rows = min(MAX_ROWS, max(MIN_ROWS, next_power_of_2(h)))
    blocks = cdiv(h, rows)
    token_bytes = (r + dr) * c_kv.dtype.itemsize
    splits = k_splits or default_mla_splits(b * blocks, max_pages, ppb, page_size, rows, r, token_bytes)
    if not interpret:
        check_mla_triton_shapes(page_size, r, dr, ppb)
    steps_per_split = cdiv(cdiv(max_pages, splits), ppb) * ppb
    pad = ((0, 0), (0, blocks * rows - h), (0, 0))
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_block=ppb, max_pages=max_pages,
                               steps_per_split=steps_per_split, scale=scale)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, blocks, splits),
        in_specs=[
            gpu_tiles.whole(lengths),
            pl.BlockSpec((None, max_pages), lambda b_, hb, s: (b_, 0)),
            pl.BlockSpec((None, rows, r), lambda b_, hb, s: (b_, hb, 0)),
            pl.BlockSpec((None, rows, dr), lambda b_, hb, s: (b_, hb, 0)),
            gpu_tiles.whole(c_kv), gpu_tiles.whole(k_rope),
        ],
        out_specs=[
            pl.BlockSpec((None, None, rows, r), lambda b_, hb, s: (s, b_, hb, 0)),
            pl.BlockSpec((None, None, rows), lambda b_, hb, s: (s, b_, hb)),
            pl.BlockSpec((None, None, rows), lambda b_, hb, s: (s, b_, hb)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, b, blocks * rows, r), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, blocks * rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, blocks * rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_decode_gpu",
    )(lengths.astype(jnp.int32), block_tables.astype(jnp.int32), jnp.pad(q_latent, pad), jnp.pad(q_rope, pad),
      c_kv, k_rope)
    m, l, acc = merge_partials(m[..., None], l[..., None], acc)  # [B, blocks * rows, ...]
    return finalize(m, l, acc)[:, :h]


def default_mla_splits(programs: int, max_pages: int, pages_per_block: int, page_size: int, rows: int, rank: int,
                       token_bytes: int) -> int:
    """Split-K (flash-decoding) splits: toward 256 programs, but with the f32 partials (rows x r,
    written and read back) at most a tenth of a full sequence's latent cache: a [64, 512] split
    costs 256 KiB, a fifth of a 1k-token sequence."""
    cache = max_pages * page_size * token_bytes
    partials = 2 * rows * (rank + 2) * 4
    return max(1, min(default_k_splits(programs, cdiv(max_pages, pages_per_block)), cache // (10 * partials)))


def check_mla_triton_shapes(page_size: int, kv_lora_rank: int, rope_dim: int, pages_per_block: int) -> None:
    """Triton's power-of-two tiles with dot dimensions >= 16, for both key parts."""
    check_triton_shapes(page_size, kv_lora_rank, pages_per_block)
    check_triton_shapes(page_size, rope_dim, pages_per_block)
