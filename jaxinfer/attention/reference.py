"""Attention over the paged KV cache: the pure-`jnp` reference of every variant, in one place.

    paged_attention_reference      MHA / GQA / MQA, sliding window, attention sinks,
                                   learned sink logits, soft-cap; any cache format
    streaming_attention_reference  StreamingLLM: sinks + a ring of recent tokens, positions
                                   assigned inside the cache
    mla_attention_reference        DeepSeek MLA over the latent cache, absorbed or expanded

These are the readable, obviously correct versions the Pallas kernels are checked against
(one reference, used by the engine's "reference" path and by every kernel test). They
gather each sequence's pages through its block table into a dense
[B, max_pages_per_seq * page_size] key axis and mask what the sequence may not see.

Masking options (shared with the kernels; defaults = plain causal attention)::

    window=3, num_sinks=1, query at cache index 5, kv_length 7:
    key j:      0 1 2 3 4 5 6
    causal:     x x x x x x .      j <= 5
    window:     . . . x x x .      5 - 3 < j <= 5
    + sinks:    x . . x x x .      j < num_sinks stays visible (StreamingLLM)

`soft_cap` squashes scores to cap * tanh(s / cap) before masking (Gemma 2); `sink_logits`
adds a learned per-head term exp(sink[h]) to the softmax denominator (gpt-oss), so a head
may put weight "nowhere".
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from jaxinfer.attention.rope import apply_rope
from jaxinfer.kv.latent import LatentKV
from jaxinfer.kv.layer_cache import LayerCache
from jaxinfer.kv.streaming import StreamingSpec, ring_logical_index

# Finite, so a row with no visible key gets finite weights instead of NaN (its output is
# then set to 0, `attention_output`).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Decode rows (one query each) over at most this many KV heads take `decode_attention`,
# which spends KV-heads times the attention FLOPs to skip two copies of the gathered KV.
DECODE_LAYOUT_MAX_KV_HEADS = 4


def paged_attention_reference(
    q: jax.Array,  # [B, T, Hq, Dh]: queries, already rotated
    layer_kv: LayerCache,  # one layer's pages, this step's keys and values already written
    block_tables: jax.Array,  # i32[B, max_pages]
    kv_lengths: jax.Array,  # i32[B]: cached tokens per sequence, this step's included
    query_index: jax.Array,  # i32[B, T]: cache position of each query (causal limit)
    scale: float,
    *,
    window: int | None = None,
    num_sinks: int = 0,
    sink_logits: jax.Array | None = None,  # f32[Hq]
    soft_cap: float | None = None,
    slots: jax.Array | None = None,  # i32[B]: cache slot of each row (quantized KIVI caches need it)
) -> jax.Array:
    """Causal GQA attention through block tables -> [B, T, Hq, Dh] (dtype of q).

    Key j of sequence b is visible to query t iff `j < kv_lengths[b]`,
    `j <= query_index[b, t]` and, with a `window`, `j > query_index[b, t] - window` or
    `j < num_sinks` (see the module docstring). Invisible keys and values are replaced
    before use, so whatever a page holds that no query may see (stale data, another
    request's KV, a released page behind the window, NaN) cannot leak.
    """
    check_mask_options(q.shape[2], window, num_sinks, sink_logits, soft_cap)
    check_batch_shapes(q, block_tables, kv_lengths, query_index)
    k, v = layer_kv.gather(block_tables, kv_lengths, slots)  # [B, S, Hkv, Dh] each, dequantized
    check_heads(q, k)
    key_index = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]  # [1, S]
    visible = visible_keys(key_index, kv_lengths, query_index, window, num_sinks)
    if q.shape[1] == 1 and k.shape[2] <= DECODE_LAYOUT_MAX_KV_HEADS:
        return decode_attention(q, k, v, visible[:, 0], scale, sink_logits=sink_logits, soft_cap=soft_cap).astype(q.dtype)
    scores = attention_scores(q, k, scale)
    return attention_output(scores, v, visible, sink_logits=sink_logits, soft_cap=soft_cap).astype(q.dtype)


def check_mask_options(num_heads: int, window, num_sinks, sink_logits, soft_cap) -> None:
    """Trace-time validation of the masking options; raises ValueError naming the bad one."""
    if window is not None and (not isinstance(window, numbers.Integral) or window <= 0):
        raise ValueError(f"window={window!r} must be None or a positive integer")
    if not isinstance(num_sinks, numbers.Integral) or num_sinks < 0:
        raise ValueError(f"num_sinks={num_sinks!r} must be a non-negative integer")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap={soft_cap!r} must be None or positive")
    if sink_logits is not None and tuple(sink_logits.shape) != (num_heads,):
        raise ValueError(f"sink_logits has shape {tuple(sink_logits.shape)}, expected ({num_heads},)")


def check_batch_shapes(q: jax.Array, block_tables: jax.Array, kv_lengths: jax.Array, query_index: jax.Array) -> None:
    """Trace-time check of the batch's arrays against q [B, T, Hq, Dh] (ValueError naming the
    array and the shape it must have)."""
    if q.ndim != 4:
        raise ValueError(f"q shape {tuple(q.shape)} must be [B, T, Hq, Dh]")
    b, t = q.shape[:2]
    for name, array, want, form in (("block_tables", block_tables, None, "[B, max_pages]"),
                                    ("kv_lengths", kv_lengths, (b,), "[B]"),
                                    ("query_index", query_index, (b, t), "[B, T]")):
        shape = tuple(array.shape)
        bad = (len(shape) != 2 or shape[0] != b) if want is None else shape != want
        if bad:
            raise ValueError(f"{name} shape {shape} must be {form} = {want or (b, 'max_pages')} for q of shape "
                             f"{tuple(q.shape)}")


def check_heads(q: jax.Array, k: jax.Array) -> None:
    """Trace-time check that queries [B, T, Hq, D] can be grouped over keys [B, S, Hkv, D]."""
    (hq, d), (hkv, dk) = q.shape[2:], k.shape[2:]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if d != dk:
        raise ValueError(f"q head_dim {d} != the cache's head_dim {dk}")


def visible_keys(
    key_index: jax.Array,  # i32[B or 1, S]: cache position of each key
    kv_lengths: jax.Array,  # i32[B]
    query_index: jax.Array,  # i32[B, T]
    window: int | None = None,
    num_sinks: int = 0,
) -> jax.Array:
    """bool[B, T, S]: which key each query may attend to (rules in the module docstring)."""
    keys = key_index[:, None, :]  # [B|1, 1, S]
    queries = query_index[:, :, None]  # [B, T, 1]
    visible = (key_index < kv_lengths[:, None])[:, None, :] & (keys <= queries)
    if window is not None:
        in_window = keys > queries - window
        if num_sinks:
            in_window = in_window | (keys < num_sinks)
        visible = visible & in_window
    return visible


def attention_scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """q: [B, T, Hq, D], k: [B, S, Hkv, D] -> f32[B, Hkv, Hq/Hkv, T, S] (query heads grouped
    by the KV head they read: head h = kv_head * group + g)."""
    check_heads(q, k)
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    return jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale


def attention_output(
    scores: jax.Array,  # f32[B, Hkv, G, T, S] from `attention_scores`
    v: jax.Array,  # [B, S, Hkv, Dv]
    visible: jax.Array,  # bool[B, T, S]
    *,
    sink_logits: jax.Array | None = None,  # f32[Hkv * G]
    soft_cap: float | None = None,
) -> jax.Array:
    """Soft-cap, mask, softmax (with an optional sink term), weight the values -> f32[B, T, Hq, Dv].

    The softmax is normalised after weighting the values: the division then runs over
    [T, Dv] per head instead of [T, S] (attention of a [1, 5] verify block over 30
    SmolLM2-shaped layers, micro-benchmark: ~4.7 -> ~3.0 ms)."""
    b, hkv, g, t, _ = scores.shape
    v = jnp.where(visible.any(axis=1)[:, :, None, None], v, 0)  # values no query sees: zeroed
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible[:, None, None, :, :], scores, MASK_VALUE)
    top = scores.max(axis=-1, keepdims=True)  # f32[B, Hkv, G, T, 1]
    if sink_logits is not None:
        sink = sink_logits.astype(jnp.float32).reshape(1, hkv, g, 1, 1)
        top = jnp.maximum(top, sink)
    weights = jnp.exp(scores - top)  # unnormalised probabilities
    total = weights.sum(axis=-1, keepdims=True) + (0.0 if sink_logits is None else jnp.exp(sink - top))
    out = jnp.einsum("bkgts,bskd->bkgtd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32) / total
    # a row that sees no key (a padded query) is 0, as in the kernels: its uniform weights would
    # average the values the sequence's other rows see
    out = jnp.where(visible.any(axis=-1)[:, None, None, :, None], out, 0)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, v.shape[-1])


def decode_attention(
    q: jax.Array,  # [B, 1, Hq, D]: one query per row
    k: jax.Array,  # [B, S, Hkv, D]: as gathered
    v: jax.Array,  # [B, S, Hkv, Dv]
    visible: jax.Array,  # bool[B, S]
    scale: float,
    *,
    sink_logits: jax.Array | None = None,  # f32[Hq]
    soft_cap: float | None = None,
) -> jax.Array:
    """`attention_scores` + `attention_output` for one query per row, laid out for XLA:CPU
    -> f32[B, 1, Hq, Dv].

    The general path's dots batch over (row, KV head), so XLA:CPU copies the gathered keys
    and values into [B, Hkv, S, D] order in every layer. Here each query head sits in the
    rows of its KV head in a block-diagonal [Hkv * D, Hq] matrix (zeros elsewhere), so both
    dots batch over rows alone and read keys and values as gathered, [B, S, Hkv * D]: Hkv
    times the (small) attention FLOPs for no copy (decode step at b = 16: -14 %, issue 22).
    """
    b, _, hq, d = q.shape
    length, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    own = jnp.eye(hkv, dtype=q.dtype)  # own[k, j] = 1 iff KV head k is KV head j
    q_block = jnp.einsum("bkgd,kj->bjdkg", q.reshape(b, hkv, g, d), own).reshape(b, hkv * d, hq)
    scores = jnp.einsum("bsc,bch->bsh", k.reshape(b, length, hkv * d), q_block,
                        preferred_element_type=jnp.float32) * scale  # f32[B, S, Hq]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible[:, :, None], scores, MASK_VALUE)
    if sink_logits is None:
        probs = jax.nn.softmax(scores, axis=1)
    else:
        sink = jnp.broadcast_to(sink_logits.astype(jnp.float32)[None, None, :], (b, 1, hq))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=1), axis=1)[:, :-1]
    values = jnp.where(visible[:, :, None], v.reshape(b, length, hkv * dv), 0)  # values no query sees: zeroed
    mixed = jnp.einsum("bsh,bsc->bhc", probs.astype(v.dtype), values, preferred_element_type=jnp.float32)
    out = jnp.einsum("bkgjd,kj->bkgd", mixed.reshape(b, hkv, g, hkv, dv), own.astype(jnp.float32))  # own blocks
    return out.reshape(b, 1, hq, dv)


def streaming_attention_reference(
    q: jax.Array,  # [B, T, Hq, Dh]: queries, NOT rotated
    k_new: jax.Array,  # [B, T, Hkv, Dh]: this step's keys, NOT rotated
    v_new: jax.Array,  # [B, T, Hkv, Dh]
    layer_kv: LayerCache,  # the ring of un-rotated keys and values BEFORE this step's write
    block_tables: jax.Array,  # i32[B, max_pages]
    cached: jax.Array,  # i32[B]: tokens the sequence had seen before this step
    num_new: jax.Array,  # i32[B]: valid tokens of this step (the rest is padding)
    streaming: StreamingSpec,
    inv_freq: jax.Array,  # f32[Dh/2]
    scale: float,
    *,
    window: int | None = None,  # the layer's own window, if narrower than `streaming.window`
) -> jax.Array:
    """StreamingLLM attention: S sinks + the W most recent tokens, positions assigned in the cache.

    The query at logical index i sees the sinks j < S and the recent keys i - W < j <= i,
    where recent keys come from the ring (`kv.streaming`) or from this step's own new keys
    (so any chunk length works with a ring of exactly W). Keys are stored un-rotated and
    rotated here by their position *inside the cache*: sinks at 0..S-1, the recent keys
    right after them, the query last (rank min(i, S + W - 1))::

        S = 2, W = 3, query i = 9:  logical  0 1 | . . . . | 7 8 9
                                    rank     0 1 |          | 2 3 4

    RoPE is relative, so recent keys are rotated by (j - cached) and the query by
    (i - cached) for the recent part, and by its rank for the sink part: all positions stay
    below S + W + T however long the sequence runs.
    """
    s, w = streaming.num_sinks, streaming.window if window is None else min(streaming.window, window)
    t = q.shape[1]
    k_old, v_old = layer_kv.gather(block_tables)
    k_old, v_old = k_old[:, : streaming.capacity], v_old[:, : streaming.capacity]
    old_index, old_valid = ring_logical_index(streaming, cached)  # [B, C]
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    query_index = cached[:, None] + steps  # [B, T]
    key_index = jnp.concatenate([old_index, query_index], axis=1)  # [B, C + T]
    key_valid = jnp.concatenate([old_valid, steps < num_new[:, None]], axis=1)

    keys, queries = key_index[:, None, :], query_index[:, :, None]
    is_sink = key_index < s
    visible = key_valid[:, None, :] & (keys <= queries) & (is_sink[:, None, :] | (keys > queries - w))

    k = apply_rope(jnp.concatenate([k_old, k_new.astype(k_old.dtype)], axis=1),
                   jnp.where(is_sink, key_index, key_index - cached[:, None]), inv_freq)
    recent = attention_scores(apply_rope(q, jnp.broadcast_to(steps, query_index.shape), inv_freq), k, scale)
    sinks = attention_scores(apply_rope(q, jnp.minimum(query_index, s + w - 1), inv_freq), k, scale)
    scores = jnp.where(is_sink[:, None, None, None, :], sinks, recent)
    v = jnp.concatenate([v_old, v_new.astype(v_old.dtype)], axis=1)
    return attention_output(scores, v, visible).astype(q.dtype)


def mla_attention_reference(
    q_nope: jax.Array,  # [B, T, H, dn]
    q_rope: jax.Array,  # [B, T, H, dr]: rotated
    latent: LatentKV,  # this step's tokens already written
    w_uk: jax.Array,  # [H, dn, r]
    w_uv: jax.Array,  # [H, dv, r]
    block_tables: jax.Array,  # i32[B, max_pages]
    kv_lengths: jax.Array,  # i32[B]: cached tokens, this step's included
    query_index: jax.Array,  # i32[B, T]
    scale: float,
    *,
    absorb: bool,
) -> jax.Array:
    """Causal MLA through block tables -> [B, T, H, dv] (dtype of q_nope).

    Per token the cache holds c (kv_lora_rank numbers) and one rotated RoPE key k_r shared by
    all heads; head h's key is [W_UK[h] c ; k_r] and its value W_UV[h] c. Two equal ways:

        expanded (absorb=False, prefill): build k_h, v_h for every cached token, ordinary MHA.
        absorbed (absorb=True, decode):   q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_rope_h . k_r,
                                          so attend in latent space (an MQA with one "KV head"
                                          of width r + dr whose values are c), then
                                          out_h = W_UV[h] (sum_j p_j c_j).
    """
    c, k_rope = latent.gather(block_tables)  # [B, S, r], [B, S, dr]
    key_index = jnp.arange(c.shape[1], dtype=jnp.int32)[None, :]
    visible = visible_keys(key_index, kv_lengths, query_index)
    if absorb:
        q = jnp.concatenate([absorb_query(q_nope, w_uk), q_rope], axis=-1)  # [B, T, H, r + dr]
        k = jnp.concatenate([c, k_rope], axis=-1)[:, :, None, :]  # [B, S, 1, r + dr]
        out_latent = attention_output(attention_scores(q, k, scale), c[:, :, None, :], visible)  # [B, T, H, r]
        return expand_latent_output(out_latent, w_uv, q_nope.dtype)
    h = q_nope.shape[2]
    k_nope = jnp.einsum("bsr,hnr->bshn", c, w_uk, preferred_element_type=jnp.float32).astype(c.dtype)
    v = jnp.einsum("bsr,hvr->bshv", c, w_uv, preferred_element_type=jnp.float32).astype(c.dtype)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (*k_rope.shape[:2], h, k_rope.shape[-1]))], axis=-1)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    return attention_output(attention_scores(q, k, scale), v, visible).astype(q_nope.dtype)


def absorb_query(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """q_nope [B, T, H, dn], W_UK [H, dn, r] -> W_UK[h]^T q_nope_h: [B, T, H, r] (dtype of q_nope)."""
    return jnp.einsum("bthn,hnr->bthr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)


def expand_latent_output(out_latent: jax.Array, w_uv: jax.Array, dtype) -> jax.Array:
    """Latent attention output [B, T, H, r], W_UV [H, dv, r] -> W_UV[h] out_h: [B, T, H, dv] of `dtype`."""
    out = jnp.einsum("bthr,hvr->bthv", out_latent.astype(w_uv.dtype), w_uv, preferred_element_type=jnp.float32)
    return out.astype(dtype)
