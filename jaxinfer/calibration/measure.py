"""Measure what each KV-cache format does to a model: per layer, per KV head, end to end.

    calib = calibrate_kv(params, config, tokens)            # tokens: i32[N, T] of real text
    plan = plan_within_budget(params, config, tokens, calib, budget_kl=0.01)
    plan.save("plan.json")                                   # init_paged_kv(..., kv_cache="plan.json")

`calibrate_kv` runs the model over calibration text with a full-precision cache and measures,
per layer, per KV head and per format:

- `score_err`: RMS error of the attention scores (logits before softmax, scale included) when
  only the keys are quantized, over every (query, visible key) pair;
- `value_err`: relative error ||P (V' - V)|| / ||P V|| of the attention output when only the
  values are quantized (P = the exact attention probabilities);
- `out_err`: relative error of the attention output with keys and values quantized;

and, end to end, the mean KL divergence of next-token distributions from the full-precision
cache's: with every layer in one format (`kl_uniform`) and with one layer at a time in a probe
format (`kl_layer`, by default). KL grows with the square of a small perturbation, so the KL of
layer l in format f is estimated as kl_probe[l] * out_err[l, f]^2 / out_err[l, probe]^2.

The planner picks the per-layer formats with the fewest bytes whose summed estimate fits the
budget (an exact multiple-choice knapsack over bytes), then `plan_within_budget` measures the
plan end to end and tightens until the measured KL fits (with a margin for unseen text).

Measurements prefill each calibration sequence in one step from position 0 through the real
cache formats' `write` / `gather` (`one_shot_round_trip`): KIVI formats quantize every full
page, as a chunked prefill does; during decode a query also sees its own page unquantized, so
decode errors are at most these.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig
from jaxinfer.kv import formats as F
from jaxinfer.kv.layer_cache import one_shot_round_trip
from jaxinfer.kv.pages import KVCacheSpec, block_table_array, gather_pages, scatter_tokens
from jaxinfer.kv.paged_state import PagedKVState, init_paged_kv, write_indices
from jaxinfer.layer_stack import unstack
from jaxinfer.model.layers import apply_rope, linear, rms_norm, rope_inv_freq, swiglu_mlp
from jaxinfer.model.params import ModelParams
from jaxinfer.model.stacking import with_layer_runs
from jaxinfer.model.transformer import TokenGroup, attention_block, forward_groups, lm_head

# ---- calibration text -----------------------------------------------------------------------


def english_text() -> str:
    """About 460k characters of offline English prose: the Python docs' topic pages (stdlib)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def text_tokens(tokenizer, n_seqs: int, seq_len: int, start: int = 0) -> np.ndarray:
    """i32[n_seqs, seq_len]: consecutive windows of `english_text()` from token `start` on.

    Disjoint `start` ranges give disjoint text (calibration vs held-out).
    """
    ids = tokenizer.encode(english_text(), add_special_tokens=False)
    need = start + n_seqs * seq_len
    if need > len(ids):
        raise ValueError(f"the calibration text has {len(ids)} tokens; {need} were asked for")
    return np.asarray(ids[start:need], np.int32).reshape(n_seqs, seq_len)


# ---- the measurements -----------------------------------------------------------------------


@dataclasses.dataclass
class KVCalibration:
    """What each candidate format costs (bytes) and does (errors) to one model on some text."""

    formats: tuple[str, ...]  # candidates, F
    reference: str  # the full-precision format errors are measured against
    page_size: int
    n_tokens: int  # calibration tokens (N sequences * T)
    bytes_per_token: np.ndarray  # f64[F]: one layer, K and V, scales included
    score_err: np.ndarray  # f32[L, Hkv, F]: RMS attention-score error from quantized keys
    value_err: np.ndarray  # f32[L, Hkv, F]: relative attention-output error from quantized values
    out_err: np.ndarray  # f32[L, Hkv, F]: relative attention-output error, both quantized
    kl_uniform: np.ndarray  # f64[F]: mean next-token KL (nats), every layer in format f
    kl_layer: np.ndarray  # f64[L, F]: mean KL with only layer l in format f (estimated, see module doc)
    probe: str | None  # format whose per-layer KL was measured (None: scaled from kl_uniform)

    @property
    def n_layers(self) -> int:
        return self.kl_layer.shape[0]

    def table(self) -> str:
        """A readable per-format summary (errors averaged over layers and heads)."""
        rows = [f"{'format':>9} {'B/token/layer':>13} {'score RMS':>9} {'value rel':>9} {'out rel':>8} {'KL all layers':>13}"]
        for i, f in enumerate(self.formats):
            rows.append(f"{f:>9} {self.bytes_per_token[i]:13.1f} {self.score_err[..., i].mean():9.4f} "
                        f"{self.value_err[..., i].mean():9.4f} {self.out_err[..., i].mean():8.4f} {self.kl_uniform[i]:13.5f}")
        return "\n".join(rows)


def _check_model(config: ModelConfig) -> None:
    if config.mla is not None:
        raise ValueError("KV-cache calibration supports per-head K/V attention, not MLA models")


def _reference_format(config: ModelConfig) -> str:
    return F.DENSE_FORMAT_OF_DTYPE[config.dtype]


def _prefill_cache(config: ModelConfig, n: int, t: int, page_size: int, kv=None) -> PagedKVState:
    """A cache for n sequences of t tokens, slot b owning pages 1 + b*p ... in order."""
    p = -(-t // page_size)
    spec = KVCacheSpec(num_pages=n * p + 1, page_size=page_size, max_slots=n, max_pages_per_seq=p)
    kv = kv if kv is not None else init_paged_kv(config, spec)
    return kv.replace(block_tables=jnp.asarray(block_table_array([list(range(1 + b * p, 1 + (b + 1) * p)) for b in range(n)], p)))


@functools.partial(jax.jit, static_argnames=("config", "page_size"))
def capture_attention_inputs(params: ModelParams, config: ModelConfig, tokens: jax.Array, page_size: int = 16):
    """Run the model layer by layer over tokens: i32[N, T] (one-shot prefill, exact cache).

    Returns (q f32[L, N, T, Hq, Dh] rotated, k, v f32[L, N, T, Hkv, Dh] as cached,
    h f32[L, N*T, D] each attention block's output, logits f32[N, T, V]). The loop mirrors
    `forward_groups`; `calibrate_kv` checks the logits against `forward_groups` and h
    against attention recomputed from (q, k, v), so a drift between the two is caught.
    """
    n, t = tokens.shape
    kv = _prefill_cache(config, n, t, page_size)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    group = TokenGroup(tokens, positions, jnp.arange(n, dtype=jnp.int32), jnp.full((n,), t, jnp.int32))
    idxs = [write_indices(kv, group.slots, group.num_new, t)]
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    x = params.embed[tokens].reshape(n * t, -1).astype(config.jnp_dtype)
    qs, hs, caches = [], [], []
    for i, (layer, layer_kv) in enumerate(zip(unstack(params.layers), kv.layers)):
        xn = rms_norm(x, layer.attn_norm, config.rms_eps)
        q = linear(xn, layer.wq, layer.bq).reshape(n, t, config.n_heads, config.head_dim)
        qs.append(apply_rope(q, positions, inv_freq))
        h, layer_kv = attention_block(config, layer, layer_kv, xn, (group,), idxs, inv_freq, window=config.window(i))
        hs.append(h)
        caches.append(layer_kv)
        x = x + h
        x = x + swiglu_mlp(rms_norm(x, layer.mlp_norm, config.rms_eps), layer.w_gate, layer.w_up, layer.w_down)
    logits = lm_head(params, rms_norm(x, params.final_norm, config.rms_eps)).reshape(n, t, -1)
    kvs = [layer.gather(kv.block_tables) for layer in caches]
    f32 = lambda xs: jnp.stack(xs).astype(jnp.float32)
    return f32(qs), f32([k[:, :t] for k, _ in kvs]), f32([v[:, :t] for _, v in kvs]), f32(hs), logits


def _visible(t: int, window: int | None) -> jax.Array:
    """bool[T, T]: causal (and sliding-window) visibility of key j to query i."""
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    vis = j <= i
    return vis if window is None else vis & (j > i - window)


def _attend(q, k, v, visible, scale):
    """q: [N, T, Hkv, G, D], k, v: [N, T, Hkv, D] -> (scores f32[N, Hkv, G, T, T], out [N, T, Hkv, G, D])."""
    s = jnp.einsum("nthgd,nshd->nhgts", q, k) * scale
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return s, jnp.einsum("nhgts,nshd->nthgd", p, v), p


def _layer_errors(q, k, v, formats: tuple[str, ...], page_size: int, window: int | None, scale: float):
    """One layer's errors per KV head and format -> (f32[3, Hkv, F]: score, value, output error;
    the exact attention output f32[N, T, Hq, Dh])."""
    exact = _exact_attention(q, k, v, window, scale)
    errs = [_format_errors(q, k, v, exact, f, page_size, window, scale) for f in formats]
    return jnp.stack(errs, axis=-1), exact[1]


@functools.partial(jax.jit, static_argnames=("window", "scale"))
def _exact_attention(q, k, v, window: int | None, scale: float):
    """-> (probabilities f32[N, Hkv, G, T, T], output f32[N, T, Hq, Dh])."""
    n, t, hq, d = q.shape
    hkv = k.shape[2]
    _, out, p = _attend(q.reshape(n, t, hkv, hq // hkv, d), k, v, _visible(t, window), scale)
    return p, out.reshape(n, t, hq, d)


@functools.partial(jax.jit, static_argnames=("fmt", "page_size", "window", "scale"))
def _format_errors(q, k, v, exact, fmt: str, page_size: int, window: int | None, scale: float):
    """f32[3, Hkv]: the score, value and output errors `fmt` causes in one layer."""
    n, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(n, t, hkv, hq // hkv, d)
    vis = _visible(t, window)
    p, out = exact
    out = out.reshape(qg.shape)
    norm = jnp.sqrt(jnp.sum(out**2, axis=(0, 1, 3, 4)))  # [Hkv]
    kq, vq = one_shot_round_trip(fmt, k, v, page_size, jnp.float32)
    ds = jnp.einsum("nthgd,nshd->nhgts", qg, kq - k) * scale
    score = jnp.sqrt(jnp.sum(jnp.where(vis, ds**2, 0), axis=(0, 2, 3, 4)) / (n * (hq // hkv) * vis.sum()))
    value = jnp.sqrt(jnp.sum(jnp.einsum("nhgts,nshd->nthgd", p, vq - v) ** 2, axis=(0, 1, 3, 4))) / norm
    _, outq, _ = _attend(qg, kq, vq, vis, scale)
    both = jnp.sqrt(jnp.sum((outq - out) ** 2, axis=(0, 1, 3, 4))) / norm
    return jnp.stack([score, value, both])


def _fake_quant(name: str, k: jax.Array, v: jax.Array, page_size: int, dtype) -> tuple[jax.Array, jax.Array]:
    """`one_shot_round_trip` without building a cache (a much smaller program to compile):
    per-token formats round-trip every token, KIVI formats every full page of [B, T, Hkv, Dh]."""
    f = F.get_format(name)
    if f.kind != "kivi":
        return F.round_trip_tokens(name, k, dtype), F.round_trip_tokens(name, v, dtype)
    b, t = k.shape[:2]
    full = t // page_size * page_size
    pages = lambda x: x[:, :full].reshape(b, full // page_size, page_size, *x.shape[2:])
    kq, vq = F.round_trip_pages(name, pages(k), pages(v), dtype)
    join = lambda q, x: jnp.concatenate([q.reshape(b, full, *x.shape[2:]), x[:, full:].astype(dtype)], axis=1)
    return join(kq, k), join(vq, v)


@struct.dataclass
class ProbeLayerKV:
    """Calibration-only cache: full-precision pages holding what format `formats[modes[slot]]`
    would return, so one compiled forward evaluates a different plan in every row.

    Valid only for a one-shot prefill from position 0 (what `calibrate_kv` runs); then it is
    exactly the real formats' result (`tests/test_kv_calibrate.py` checks this).
    """

    k: jax.Array  # [num_pages, page_size, Hkv, Dh]
    v: jax.Array
    modes: jax.Array  # i32[max_slots]: index into `formats` per slot
    formats: tuple[str, ...] = struct.field(pytree_node=False)

    def write(self, k, v, idx):
        ps = self.k.shape[1]
        trips = [_fake_quant(f, k, v, ps, self.k.dtype) for f in self.formats]
        mode = self.modes[idx.slots][:, None, None, None]
        kq = jnp.select([mode == i for i in range(len(trips))], [kk for kk, _ in trips])
        vq = jnp.select([mode == i for i in range(len(trips))], [vv for _, vv in trips])
        return self.replace(k=scatter_tokens(self.k, kq, idx), v=scatter_tokens(self.v, vq, idx))

    def gather(self, block_tables, lengths=None, slots=None):
        return gather_pages(self.k, block_tables), gather_pages(self.v, block_tables)


@functools.partial(jax.jit, static_argnames=("config", "formats", "page_size"))
def _probe_stats(params: ModelParams, config: ModelConfig, tokens: jax.Array, modes: jax.Array,
                 formats: tuple[str, ...], page_size: int):
    """tokens: i32[R, T], modes: i32[L, R] -> (kl f32[R, T] against row 0, nll f32[R, T-1])."""
    r, t = tokens.shape
    kv = _prefill_cache(config, r, t, page_size)
    kv = kv.replace(layers=tuple(ProbeLayerKV(k=layer.k, v=layer.v, modes=modes[i], formats=formats)
                                 for i, layer in enumerate(kv.layers)))
    group = TokenGroup(tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t)),
                       jnp.arange(r, dtype=jnp.int32), jnp.full((r,), t, jnp.int32))
    (logits,), _ = forward_groups(with_layer_runs(params, None), config, kv, (group,))
    return logprob_stats(logits, logits[:1], tokens)


def logprob_stats(logits: jax.Array, ref_logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> (KL(ref || logits) per position f32[B, T], next-token NLL f32[B, T-1])."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ref = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1)
    nll = -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return kl, nll


def measure_plans(params: ModelParams, config: ModelConfig, tokens: np.ndarray, plans: list[tuple[str, ...]],
                  page_size: int = 16, rows: int = 8, with_ref_nll: bool = False, formats: tuple[str, ...] = ()):
    """Mean next-token KL against the full-precision cache for each per-layer plan -> f64[len(plans)]
    (and, `with_ref_nll`, the full-precision cache's mean next-token NLL).

    Every plan runs over every sequence of tokens: i32[N, T]; up to `rows` rows per compiled
    forward (row 0 the reference), so all plans share one program. Passing the same
    `formats` (a superset of those the plans use) across calls reuses that program.
    """
    _check_model(config)
    formats = tuple(dict.fromkeys((_reference_format(config),) + tuple(formats) + tuple(f for p in plans for f in p)))
    for p in plans:
        if len(p) != config.n_layers:
            raise ValueError(f"a plan has {len(p)} layers, the model {config.n_layers}")
    codes = np.array([[formats.index(f) for f in p] for p in plans], np.int32).reshape(len(plans), config.n_layers)
    kl_sum, ref_nll = np.zeros(len(plans)), []
    per_chunk = rows - 1
    for seq in np.asarray(tokens):
        for start in range(0, len(plans), per_chunk):
            chunk = codes[start : start + per_chunk]
            modes = np.zeros((rows, config.n_layers), np.int32)  # row 0 and padding: the reference
            modes[1 : 1 + len(chunk)] = chunk
            kl, nll = _probe_stats(params, config, jnp.asarray(np.broadcast_to(seq, (rows, len(seq)))),
                                   jnp.asarray(modes.T), formats, page_size)
            kl_sum[start : start + len(chunk)] += np.asarray(kl, np.float64)[1 : 1 + len(chunk)].mean(axis=1)
            ref_nll.append(float(np.mean(np.asarray(nll)[0])))
    return (kl_sum / len(tokens), float(np.mean(ref_nll))) if with_ref_nll else kl_sum / len(tokens)


def calibrate_kv(params: ModelParams, config: ModelConfig, tokens: np.ndarray,
                 formats: tuple[str, ...] = F.FORMAT_NAMES, page_size: int = 16,
                 probe: str | None = "int4", rows: int = 8) -> KVCalibration:
    """Measure every candidate format on tokens: i32[N, T] (see the module docstring).

    `probe` is the format whose per-layer end-to-end KL is measured (L extra forwards per
    sequence); with None, per-layer KL is apportioned from `kl_uniform` by squared output error.
    """
    _check_model(config)
    formats = tuple(formats)
    for f in formats:
        F.get_format(f)
    ref = _reference_format(config)
    if ref not in formats:
        formats = (ref,) + formats  # the lossless choice keeps every budget feasible
    tokens = np.asarray(tokens, np.int32)
    q, k, v, h, logits = capture_attention_inputs(params, config, jnp.asarray(tokens), page_size)

    scale = 1.0 / math.sqrt(config.head_dim)
    errs = []
    for layer in range(config.n_layers):
        e, out = _layer_errors(q[layer], k[layer], v[layer], formats, page_size, config.window(layer), scale)
        _check_attention(params, layer, out, h[layer])
        errs.append(np.asarray(e))
    errs = np.stack(errs)  # [L, 3, Hkv, F]

    L = config.n_layers
    plans = [(f,) * L for f in formats]
    if probe is not None:
        F.get_format(probe)
        plans += [tuple(probe if i == j else ref for i in range(L)) for j in range(L)]
    kls, ref_nll = measure_plans(params, config, tokens, plans, page_size, rows, with_ref_nll=True, formats=formats)
    _check_capture(logits, tokens, ref_nll)
    kl_uniform = kls[: len(formats)]
    out_sq = np.mean(errs[:, 2] ** 2, axis=1)  # [L, F]: squared output error, averaged over heads
    if probe is not None:
        pi = formats.index(probe) if probe in formats else None
        probe_sq = out_sq[:, pi] if pi is not None else np.mean(_probe_out_sq(q, k, v, probe, page_size, config), axis=1)
        kl_layer = kls[len(formats):, None] * out_sq / np.maximum(probe_sq[:, None], 1e-30)
    else:
        kl_layer = kl_uniform[None, :] * out_sq / np.maximum(out_sq.sum(axis=0, keepdims=True), 1e-30)
    kl_layer[:, formats.index(ref)] = 0.0
    return KVCalibration(
        formats=formats, reference=ref, page_size=page_size, n_tokens=int(tokens.size),
        bytes_per_token=np.array([F.get_format(f).bytes_per_token(config.n_kv_heads, config.head_dim, page_size) for f in formats]),
        score_err=errs[:, 0], value_err=errs[:, 1], out_err=errs[:, 2],
        kl_uniform=kl_uniform, kl_layer=kl_layer, probe=probe,
    )


def _probe_out_sq(q, k, v, probe, page_size, config) -> np.ndarray:
    """[L, Hkv] squared output error of a probe format that is not a candidate."""
    scale = 1.0 / math.sqrt(config.head_dim)
    return np.stack([np.asarray(_layer_errors(q[i], k[i], v[i], (probe,), page_size, config.window(i), scale)[0])[2, :, 0] ** 2
                     for i in range(config.n_layers)])


def _check_capture(logits, tokens, ref_nll: float) -> None:
    """The layer-by-layer capture must reproduce the model's own forward (same mean NLL)."""
    _, nll = logprob_stats(logits, logits, jnp.asarray(tokens))
    got = float(jnp.mean(nll))
    if not abs(got - ref_nll) <= 1e-4 * max(1.0, abs(ref_nll)):
        raise RuntimeError(f"calibration capture drifted from forward_groups (mean NLL {got:.6f} vs {ref_nll:.6f}); "
                           "update capture_attention_inputs to match the model")


def _check_attention(params, layer, out, h) -> None:
    """Attention recomputed from the captured q, k, v must give the attention block's output."""
    wo = unstack(params.layers)[layer].wo
    got = linear(out.reshape(h.shape[0], -1), wo)
    err = float(jnp.max(jnp.abs(got - h)))
    if not err <= 1e-3 * max(1.0, float(jnp.max(jnp.abs(h)))):
        raise RuntimeError(f"layer {layer}: attention from the captured queries differs from the model's by {err:.3g}; "
                           "update capture_attention_inputs to match attention_block")


# ---- evaluation through the real cache formats --------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill_logits(params: ModelParams, config: ModelConfig, tokens: jax.Array, kv: PagedKVState) -> jax.Array:
    n, t = tokens.shape
    group = TokenGroup(tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t)),
                       jnp.arange(n, dtype=jnp.int32), jnp.full((n,), t, jnp.int32))
    (logits,), _ = forward_groups(with_layer_runs(params, None), config, kv, (group,))
    return logits


def evaluate_kv_cache(params: ModelParams, config: ModelConfig, tokens: np.ndarray, kv_cache,
                      page_size: int = 16, ref_logits: jax.Array | None = None) -> dict:
    """Prefill tokens: i32[N, T] through a real `kv_cache` (name, plan or path) and compare with
    the full-precision cache -> {"kl": mean KL, "nll": mean NLL, "ref_nll": reference mean NLL}.

    Pass `ref_logits` (from `reference_logits`) to reuse the reference across formats.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    n, t = tokens.shape
    if ref_logits is None:
        ref_logits = reference_logits(params, config, tokens, page_size)
    spec = KVCacheSpec(num_pages=n * -(-t // page_size) + 1, page_size=page_size, max_slots=n, max_pages_per_seq=-(-t // page_size))
    kv = _prefill_cache(config, n, t, page_size, init_paged_kv(config, spec, kv_cache=kv_cache))
    kl, nll = logprob_stats(_prefill_logits(params, config, tokens, kv), ref_logits, tokens)
    _, ref_nll = logprob_stats(ref_logits, ref_logits, tokens)
    return {"kl": float(jnp.mean(kl)), "nll": float(jnp.mean(nll)), "ref_nll": float(jnp.mean(ref_nll))}


def reference_logits(params: ModelParams, config: ModelConfig, tokens, page_size: int = 16) -> jax.Array:
    """f32[N, T, V] logits of a one-shot prefill with the model's full-precision cache."""
    tokens = jnp.asarray(tokens, jnp.int32)
    n, t = tokens.shape
    return _prefill_logits(params, config, tokens, _prefill_cache(config, n, t, page_size))
