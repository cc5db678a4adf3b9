"""Bytes the decode kernels move per decoded token vs what the cache must supply (pallas_kernels.traffic)."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import traffic
from pallas_kernels.common import AttentionOptions
from pallas_kernels.lowering import OPTIONS, MlaShape, Shape

SHAPE = Shape(batch=4, q_heads=32, kv_heads=8, head_dim=128, page_size=16, context=2048)  # 128 pages per sequence


def test_tpu_blocks_fetch_each_needed_page_once_in_fewer_grid_steps():
    """All 2k tokens: 128 pages per sequence, fetched once each whether a grid step holds one
    page or eight; eight per step means 8x fewer grid steps. Dense bf16 moves the cache bytes
    plus only the query and output rows."""
    lengths = [2048] * 4
    one, block = traffic.tpu_decode("dense", SHAPE, lengths, pages_per_block=1), traffic.tpu_decode("dense", SHAPE, lengths)
    assert one.dmas == block.dmas == 4 * 128
    assert (one.grid_steps, block.grid_steps) == (4 * 128, 4 * 16)
    assert 1.0 < block.ratio < 1.003  # + q in, output out: 2 * 32 * 128 * 2 bytes per 8 MiB sequence


def test_tpu_walk_stops_at_the_length_and_the_window():
    """Pages past a sequence's length or wholly behind its window are never fetched: a ragged
    batch costs the pages its tokens span; with window 1024 + 4 sinks, 64 + 1 (+1 straddling) pages."""
    lengths = [2048, 1000, 17, 300]
    t = traffic.tpu_decode("int8", SHAPE, lengths)
    assert t.dmas == 128 + 63 + 2 + 19 + (8 - 2)  # the 17-token sequence: 2 pages, 6 idle slots fetch a copy
    w = traffic.tpu_decode("int8", SHAPE, [2048] * 4, OPTIONS)
    assert w.dmas == 4 * (1 + 64)  # sink page + window pages [1024, 2048) (aligned: 64 pages)
    assert w.ratio < 1.02


@pytest.mark.parametrize("fmt", ["dense", "int8", "fp8_e4m3", "int4", "int2"])
def test_moved_bytes_stay_near_the_cache_bytes(fmt):
    """Ragged lengths 1-2k. The GPU kernel's overhead is its split-K partials, f32 [splits,
    16 rows, D] written and re-read per program; the query heads of 4 KV heads (GQA groups of
    4) share a program's 16 rows (they were padded to 16 rows per KV head: int2 at batch 64
    moved 1.20x its cache, now 1.10x). At batch 4 the kernel splits each walk 8 ways (256
    programs wanted), and the partials cost more than 10 % even of the bf16 cache."""
    lengths = np.random.default_rng(0).integers(1, 2049, size=64)
    wide = Shape(batch=64, q_heads=32, kv_heads=8, head_dim=128, page_size=16, context=2048)
    assert 1.0 <= traffic.tpu_decode(fmt, SHAPE, lengths[:4]).ratio < 1.05
    assert 1.0 <= traffic.gpu_decode(fmt, wide, lengths).ratio < 1.1
    assert traffic.gpu_decode(fmt, SHAPE, lengths[:4]).ratio > 1.1


def test_decode_grid_spans_the_window_not_the_context():
    """With window 1024 + 4 sinks a decode walk has at most 1 + 64 + 1 = 66 steps of 128: the
    TPU grid has cdiv(66, 8) = 9 steps per sequence, not 16, and fetches the 65 pages once."""
    t = traffic.tpu_decode("int8", SHAPE, [2048] * 4, OPTIONS)
    assert (t.grid_steps, t.dmas) == (4 * 9, 4 * 65)


def test_cache_bytes_count_visible_tokens():
    opts = AttentionOptions(window=8, num_sinks=2)
    assert traffic.visible_tokens(20, opts) == 8 + 2 and traffic.visible_tokens(9, opts) == 8 + 1
    assert traffic.visible_tokens(5, opts) == 5 and traffic.visible_tokens(20, AttentionOptions()) == 20
    # dense bf16: 2 (K, V) * 8 heads * 128 channels * 2 bytes per token
    assert traffic.cache_bytes("dense", SHAPE, [3, 5], AttentionOptions()) == 8 * 2 * 8 * 128 * 2


def test_mla_tpu_walk_copies_each_latent_page_once_and_gpu_head_blocks_reread():
    """Lengths 1, 100, 129 and 256 at page 16, 8 page slots per grid step, 2 steps: the TPU MLA
    walk copies 8 + 8 + 9 + 16 blocks (a short walk's spare slots re-name its last page, copied
    once per slot; past a length nothing more); the GPU kernel's 128 heads are 2 blocks of 64
    rows, each reading the sequence's tokens, so at 8k it moves over twice the cache bytes."""
    shape, lengths = MlaShape(batch=4, heads=16, context=256), [1, 100, 129, 256]
    tpu = traffic.mla_decode("tpu", shape, lengths)
    assert tpu.dmas == 41 and tpu.grid_steps == 8
    token = (512 + 64) * 2
    assert tpu.cache == sum(lengths) * token
    assert tpu.moved == 41 * 16 * token + 4 * (16 * token + 16 * 512 * 4)  # pages, queries, f32 outputs
    gpu = traffic.mla_decode("gpu", MlaShape(batch=4, heads=128, context=8192), [8192] * 4)
    assert 2.0 < gpu.ratio < 3.0  # 2 reads of the cache, then split-K partials
