"""What every paged-attention kernel here shares: options, visibility, page schedule, online softmax.

Visibility. Key j (a cache position) is visible to a query at cache position i of a sequence
holding `length` tokens iff::

    j < length  and  j <= i  and  (window is None  or  i - window < j  or  j < num_sinks)

Page schedule. A block of queries spanning cache positions [q_lo, q_hi] needs only the logical
pages that hold a key one of them can see: the sink pages, then the window pages. Kernels walk
the schedule step by step; steps past `count` do nothing (and on TPU re-name the last page, so
no new page is fetched)::

    page_size = 4, window = 6, num_sinks = 2, length = 23, q_lo = q_hi = 22
    cache position: 0 1 2 3 | 4 .. 15 | 16 17 18 19 | 20 21 22
    logical page:   0       | 1 .. 3  | 4           | 5
    visible:        0 1     |         |    17 18 19 | 20 21 22
    schedule:       step 0 -> page 0 (sinks), step 1 -> page 4, step 2 -> page 5; count = 3
                    pages 1..3 lie wholly outside the window and are never read

Online softmax. Each tile of keys updates a carry (m, l, acc) per query row: m the running
max score, l the running sum of exp(score - m), acc the running sum of exp(score - m) * v.
`finalize` adds the optional sink logit (an extra exp(sink) term in the denominator) and
divides; a row that sees no key and has no sink returns zeros.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Same finite value as jaxinfer's reference: exp(MASK_VALUE - real score) == 0 exactly.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Static mask options shared by the reference and the kernels (hashable: a jit static)."""

    window: int | None = None  # query i sees keys j with i - window < j <= i
    num_sinks: int = 0  # keys j < num_sinks are always visible (within causality and length)
    soft_cap: float | None = None  # scores become soft_cap * tanh(score / soft_cap) before masking

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, numbers.Integral) or self.window <= 0):
            raise ValueError(f"window={self.window!r} must be a positive int or None")
        if not isinstance(self.num_sinks, numbers.Integral) or self.num_sinks < 0:
            raise ValueError(f"num_sinks={self.num_sinks!r} must be a non-negative int")
        for name in ("window", "num_sinks"):  # numpy integers as ints: hashed and printed alike
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"soft_cap={self.soft_cap!r} must be positive or None")


def visible(key_pos: jax.Array, query_pos: jax.Array, length: jax.Array, opts: AttentionOptions) -> jax.Array:
    """bool, broadcast of the int32 inputs: may the query at `query_pos` see the key at `key_pos`?"""
    return visible_span(key_pos, query_pos, query_pos, length, opts)


def visible_span(key_pos, q_lo, q_hi, length, opts: AttentionOptions) -> jax.Array:
    """bool: may some query at a cache position in [q_lo, q_hi] see the key at `key_pos`?"""
    ok = (key_pos < length) & (key_pos <= q_hi)
    if opts.window is not None:
        recent = key_pos > q_lo - opts.window
        if opts.num_sinks:
            recent = recent | (key_pos < opts.num_sinks)
        ok = ok & recent
    return ok


def cap_scores(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def cdiv(a, b):
    return (a + b - 1) // b


class PageSchedule(NamedTuple):
    """Logical pages a query block reads, as int32 scalars: [0, sink_pages) then [first, end)."""

    sink_pages: jax.Array
    first: jax.Array
    end: jax.Array

    @property
    def count(self) -> jax.Array:
        return self.sink_pages + jnp.maximum(self.end - self.first, 0)

    def logical_page(self, step: jax.Array) -> jax.Array:
        """Logical page read at schedule `step` (meaningful for step < count)."""
        return jnp.where(step < self.sink_pages, step, self.first + step - self.sink_pages)


def page_schedule(length, q_lo, q_hi, page_size: int, opts: AttentionOptions) -> PageSchedule:
    """The pages holding keys visible to some query at a cache position in [q_lo, q_hi].

    Visible keys: sinks j < min(num_sinks, last + 1) and the window keys [first_key, last],
    where last = min(length - 1, q_hi) and first_key = max(q_lo - window + 1, 0).
    """
    last = jnp.minimum(length - 1, q_hi)
    end = jnp.where(last >= 0, last // page_size + 1, 0).astype(jnp.int32)
    if opts.window is None:
        zero = jnp.zeros_like(end)
        return PageSchedule(zero, zero, end)
    first_key = jnp.maximum(q_lo - opts.window + 1, 0)
    sink_pages = cdiv(jnp.clip(last + 1, 0, opts.num_sinks), page_size).astype(jnp.int32)
    has_window = first_key <= last
    first = jnp.where(has_window, first_key // page_size, sink_pages).astype(jnp.int32)
    end = jnp.where(has_window, end, sink_pages)
    return PageSchedule(jnp.minimum(sink_pages, first), first, end)


def decode_steps(max_pages: int, page_size: int, opts: AttentionOptions) -> int:
    """Most schedule steps one query can have (static): every page, or with a window the sink
    pages plus the cdiv(window - 1, S) + 1 pages a window can straddle."""
    if opts.window is None:
        return max_pages
    return min(max_pages, cdiv(opts.num_sinks, page_size) + cdiv(opts.window - 1, page_size) + 1)


class Carry(NamedTuple):
    """Online-softmax state per query row: m, l f32[R, 1]; acc: channel parts f32[R, Dh / parts]."""

    m: jax.Array
    l: jax.Array
    acc: tuple[jax.Array, ...]


def init_carry(rows: int, head_dim: int, parts: int = 1) -> Carry:
    return Carry(
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        tuple(jnp.zeros((rows, head_dim // parts), jnp.float32) for _ in range(parts)),
    )


def attend_tile(
    carry: Carry,
    q: tuple[jax.Array, ...],  # channel parts [R, Dh / parts] (compute dtype)
    k: tuple[jax.Array, ...],  # channel parts [N, Dh / parts]
    v: tuple[jax.Array, ...],  # channel parts [N, Dh / parts]
    vis: jax.Array,  # bool[R, N] (or broadcastable)
    key_ok: jax.Array,  # bool[N, 1]: key is visible to some row (others' values are zeroed)
    *,
    scale: float,
    soft_cap: float | None,
) -> Carry:
    """Fold one tile of N keys into the carry; scores add up over the channel parts."""
    nt = (((1,), (1,)), ((), ()))  # q @ k.T
    scores = sum(jax.lax.dot_general(qp, kp.astype(qp.dtype), nt, preferred_element_type=jnp.float32)
                 for qp, kp in zip(q, k)) * scale
    scores = jnp.where(vis, cap_scores(scores, soft_cap), MASK_VALUE)
    m_new = jnp.maximum(carry.m, jnp.max(scores, axis=1, keepdims=True))
    correction = jnp.exp(carry.m - m_new)
    p = jnp.where(vis, jnp.exp(scores - m_new), 0.0)
    l_new = correction * carry.l + jnp.sum(p, axis=1, keepdims=True)
    dtype = q[0].dtype
    acc = tuple(
        correction * a + jax.lax.dot_general(  # NaN or stale values of unseen keys cannot leak
            p.astype(dtype), jnp.where(key_ok, vp, 0).astype(dtype), (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32)
        for a, vp in zip(carry.acc, v))
    return Carry(m_new, l_new, acc)


def merge_partials(m: jax.Array, l: jax.Array, acc: jax.Array, axis: int = 0):
    """Combine partial results stacked along `axis` (split-K decode): m, l [..., R, 1], acc [..., R, Dh]."""
    m_max = jnp.max(m, axis=axis)
    w = jnp.exp(m - jnp.expand_dims(m_max, axis))
    return m_max, jnp.sum(w * l, axis=axis), jnp.sum(w * acc, axis=axis)


def finalize(m: jax.Array, l: jax.Array, acc: jax.Array, sink: jax.Array | None = None) -> jax.Array:
    """acc / l -> f32[..., R, Dh], with exp(sink - m) added to l when `sink` (f32[..., R, 1]) is given."""
    if sink is not None:
        m_new = jnp.maximum(m, sink)
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.exp(sink - m_new)
        acc = acc * correction
    return acc / jnp.where(l > 0, l, 1.0)


def check_decode_shapes(q, pages, block_tables, lengths, query_pos) -> None:
    """Trace-time shape checks shared by the decode kernels (q [B, Hq, Dh])."""
    b, hq, dh = q.shape
    if hq % pages.num_kv_heads:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {pages.num_kv_heads}")
    if dh != pages.head_dim:
        raise ValueError(f"q head_dim {dh} != pages head_dim {pages.head_dim}")
    if block_tables.shape[0] != b or block_tables.ndim != 2:
        raise ValueError(f"block_tables shape {block_tables.shape} must be [{b}, max_pages]")
    for name, a in (("lengths", lengths), ("query_pos", query_pos)):
        if a.shape != (b,):
            raise ValueError(f"{name} shape {a.shape} must be ({b},)")


def prefill_rows(q, query_pos, hkv: int, g_pad: int, t_pad: int, block_q: int):
    """q [B, T, Hq, Dh] -> rows [B, Hkv, T_pad * G_pad, Dh] (row = t * G_pad + g), their query
    positions i32[B, T_pad * G_pad] (padding: -1, sees nothing) and each query block's
    [q_lo, q_hi] i32[B, T_pad / block_q] over its real queries (empty block: [0, -1])."""
    b, t, hq, dh = q.shape
    group = hq // hkv
    qg = q.reshape(b, t, hkv, group, dh).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, Dh]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, t_pad - t), (0, g_pad - group), (0, 0)))
    pos, q_lo, q_hi = query_blocks(query_pos, t_pad, block_q)
    row_pos = jnp.repeat(pos.reshape(b, t_pad), g_pad, axis=1)
    return qg.reshape(b, hkv, t_pad * g_pad, dh), row_pos, q_lo, q_hi


def query_blocks(query_pos, t_pad: int, block_q: int):
    """query_pos i32[B, T] -> positions padded with -1 (sees nothing) i32[B, T_pad / block_q,
    block_q] and each block's [q_lo, q_hi] i32[B, T_pad / block_q] over its real queries (an
    empty block: [0, -1])."""
    b, t = query_pos.shape
    pos = jnp.pad(query_pos.astype(jnp.int32), ((0, 0), (0, t_pad - t)), constant_values=-1)
    pos = pos.reshape(b, t_pad // block_q, block_q)
    real = (jnp.arange(t_pad) < t).reshape(t_pad // block_q, block_q)
    q_hi = jnp.max(jnp.where(real, pos, -1), axis=2)
    q_lo = jnp.where(q_hi < 0, 0, jnp.min(jnp.where(real, pos, jnp.iinfo(jnp.int32).max), axis=2))
    return pos, q_lo, q_hi


def check_prefill_shapes(q, pages, block_tables, lengths, query_pos) -> None:
    """Trace-time shape checks shared by the chunked-prefill kernels (q [B, T, Hq, Dh])."""
    b, t, hq, dh = q.shape
    if hq % pages.num_kv_heads:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {pages.num_kv_heads}")
    if dh != pages.head_dim:
        raise ValueError(f"q head_dim {dh} != pages head_dim {pages.head_dim}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables shape {block_tables.shape} must be [{b}, max_pages]")
    if lengths.shape != (b,) or query_pos.shape != (b, t):
        raise ValueError(f"lengths {lengths.shape} / query_pos {query_pos.shape} must be ({b},) / ({b}, {t})")


def check_sink_logits(sink_logits, num_heads: int) -> None:
    if sink_logits is not None and sink_logits.shape != (num_heads,):
        raise ValueError(f"sink_logits shape {sink_logits.shape} must be ({num_heads},)")


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_mla_shapes(q_latent, q_rope, c_kv, k_rope, block_tables, lengths) -> None:
    """Trace-time shape checks shared by the MLA decode kernels (q_latent [B, H, r], c_kv [P, S, r])."""
    b, h, r = q_latent.shape
    if q_rope.shape[:2] != (b, h) or c_kv.shape[-1] != r or k_rope.shape[:2] != c_kv.shape[:2] \
            or k_rope.shape[-1] != q_rope.shape[-1]:
        raise ValueError(f"q_latent {q_latent.shape} / q_rope {q_rope.shape} must be [B, H, r] / [B, H, dr] and "
                         f"c_kv {c_kv.shape} / k_rope {k_rope.shape} [P, S, r] / [P, S, dr]")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"block_tables {block_tables.shape} / lengths {lengths.shape} must be [{b}, max_pages] / ({b},)")
