"""The Llama-family forward pass over a paged KV cache, as one pure function.

A call evaluates one or more *token groups*. Each group is a padded [B, T] block of rows,
each row appending to one cache slot: e.g. a decode group [max_slots, 1] plus a prefill
group [P, prefill_chunk]. Dense layers run over all groups' tokens at once (one matmul per
weight); attention runs per group, through that group's rows of the block table.

The layers run as the params and cache are laid out (`jaxinfer.layer_stack`): a tuple of
per-layer pytrees is unrolled into the program; runs of alike layers stacked along a leading
axis run as one `lax.scan` each, so the program stops growing with depth (on XLA:CPU the
unrolled program decodes faster, elsewhere the scan compiles far faster: `jaxinfer.model.stacking`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.attention import dispatch
from jaxinfer.attention.mesh import sharded_write_and_attend, write_and_attend
from jaxinfer.attention.rope import apply_rope, rope_inv_freq
from jaxinfer.config import ModelConfig
from jaxinfer.kv.allocator import check_replica_pages
from jaxinfer.kv.layer_cache import LayerCache, stored_kv_heads
from jaxinfer.kv.pages import WriteIndices, drop_writes_below
from jaxinfer.kv.paged_state import PagedKVState, write_indices
from jaxinfer.kv.streaming import StreamingSpec
from jaxinfer.kv.window_ring import ring_indices
from jaxinfer.layer_stack import LayerStack, run_lengths
from jaxinfer.model.layers import geglu_mlp, linear, linears, rms_norm, swiglu_mlp
from jaxinfer.model.mla import mla_attention
from jaxinfer.model.moe import moe_mlp
from jaxinfer.model.params import LayerParams, MLALayerParams, ModelParams


@struct.dataclass
class TokenGroup:
    """Rows of new tokens, each appended to one cache slot."""

    tokens: jax.Array  # i32[B, T]
    positions: jax.Array  # i32[B, T]: RoPE positions of the tokens
    slots: jax.Array  # i32[B]: cache slot of each row (distinct across all groups of a call)
    num_new: jax.Array  # i32[B]: valid tokens per row; the rest is padding, 0 = idle row
    logits_index: jax.Array | None = None  # i32[B]: if given, logits only at this position
    # Static: rows come in D equal blocks, block r continuing data replica r's slots (the
    # decode group, row b = slot b; the engine's prefill rows): on a mesh they split over
    # `data`. Other groups are shared by every data replica.
    by_replica: bool = struct.field(pytree_node=False, default=False)
    # i32[B]: each row's sequence holds its first `shared[b]` tokens in pages taken from the
    # prefix cache, which other requests may read: the layers writing block-table pages drop
    # writes there (a hybrid model recomputes some of them for its windowed layers' rings:
    # `jaxinfer.kv.window_ring.hit_recompute`). None: nothing shared is recomputed.
    shared: jax.Array | None = None


def _split(x: jax.Array, groups: tuple[TokenGroup, ...]) -> list[jax.Array]:
    """Flat [N, ...] -> per-group [B_g, T_g, ...] (inverse of concatenating reshaped groups)."""
    out, start = [], 0
    for g in groups:
        b, t = g.tokens.shape
        out.append(x[start : start + b * t].reshape(b, t, *x.shape[1:]))
        start += b * t
    return out


def _flat(parts: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([p.reshape(-1, *p.shape[2:]) for p in parts])


def attention_block(
    config: ModelConfig,
    layer: LayerParams | MLALayerParams,
    layer_kv: LayerCache,  # this layer's cache (or a view into its run's, `jaxinfer.kv.layer_cache`)
    x: jax.Array,  # [N, D]: every group's tokens, flattened, already normed
    groups: tuple[TokenGroup, ...],
    idxs: list[WriteIndices],
    inv_freq: jax.Array,  # f32[Dh/2]
    *,
    window: int | None = None,  # this layer's sliding window (`ModelConfig.window`)
    streaming: StreamingSpec | None = None,  # the cache's `PagedKVState.streaming`
    max_slots: int = 0,  # the cache's slots (needed on a mesh only)
    attention_impl: str = "reference",  # "auto" | "reference" | "pallas" (`jaxinfer.attention.dispatch`)
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[jax.Array, LayerCache]:
    """Project, rotate, write every group's K/V into the pages, attend per group (per device
    under `shard_map` on a mesh: `jaxinfer.attention.mesh`) -> ([N, D], the layer's new cache).
    Every variant (paged, MLA, StreamingLLM ring) goes through `jaxinfer.attention.dispatch`
    with `attention_impl`."""
    c = config
    if c.mla is not None:
        outs, layer_kv = mla_attention(c, layer, _split(x, groups), [g.positions for g in groups], idxs,
                                       inv_freq, layer_kv, attention_impl)
        return linear(_flat(outs), layer.wo), layer_kv
    q, k, v = linears(x, (layer.wq, layer.wk, layer.wv), (layer.bq, layer.bk, layer.bv))
    qs = _split(q.reshape(-1, c.n_heads, c.head_dim), groups)
    ks = _split(k.reshape(-1, c.n_kv_heads, c.head_dim), groups)
    vs = _split(v.reshape(-1, c.n_kv_heads, c.head_dim), groups)
    if c.qk_norm:  # per head, before RoPE (Gemma 3, Qwen3)
        qs = [rms_norm(q, layer.q_norm, c.rms_eps) for q in qs]
        ks = [rms_norm(k, layer.k_norm, c.rms_eps) for k in ks]
    copies = stored_kv_heads(layer_kv) // c.n_kv_heads
    if copies > 1:  # the pool keeps each KV head `copies` times (`jaxinfer.sharding.kv_head_copies`)
        ks = [jnp.repeat(k, copies, axis=2) for k in ks]  # [B, T, Hkv * copies, Dh]
        vs = [jnp.repeat(v, copies, axis=2) for v in vs]
    if streaming is not None:
        outs, layer_kv = _streaming_attention(c, window, streaming, qs, ks, vs, idxs, inv_freq, layer_kv, attention_impl)
        return linear(_flat(outs).reshape(x.shape[0], -1), layer.wo, layer.bo), layer_kv
    qs = [apply_rope(q, g.positions, inv_freq) for q, g in zip(qs, groups)]
    ks = [apply_rope(k, g.positions, inv_freq) for k, g in zip(ks, groups)]

    def attend(q, layer_kv, idx):
        sinks = layer.sinks  # f32[Hq]
        if sinks is not None and sinks.shape[0] != q.shape[2]:  # under shard_map: this device's block of query heads
            sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index("model") * q.shape[2], q.shape[2])
        return dispatch.paged_attention(q, layer_kv, idx.block_tables, idx.new_lengths, idx.cache_index,
                                        scale=c.attention_scale, window=window, sink_logits=sinks,
                                        soft_cap=c.attn_softcap, slots=idx.slots, impl=attention_impl)

    if mesh is not None and layer_kv.splits_over_mesh:
        outs, layer_kv = sharded_write_and_attend(mesh, layer_kv, qs, ks, vs, idxs, tuple(g.by_replica for g in groups),
                                                  attend, max_slots)
    else:  # one device, or a format GSPMD partitions by itself
        outs, layer_kv = write_and_attend(layer_kv, qs, ks, vs, idxs, attend)
    return linear(_flat(outs).reshape(x.shape[0], -1), layer.wo, layer.bo), layer_kv


def _streaming_attention(c: ModelConfig, window: int | None, streaming: StreamingSpec, qs, ks, vs, idxs, inv_freq,
                         layer_kv: LayerCache, attention_impl: str):
    """Bounded sink + ring cache: attend over the ring as it was plus this step's own
    (un-rotated) keys, then write them; token positions are assigned inside the cache."""
    outs = [
        dispatch.streaming_attention(q, k, v, layer_kv, idx.block_tables, idx.cache_index[:, 0],
                                     idx.new_lengths - idx.cache_index[:, 0], streaming, inv_freq,
                                     c.attention_scale, window=window, impl=attention_impl)
        for q, k, v, idx in zip(qs, ks, vs, idxs)
    ]
    for k, v, idx in zip(ks, vs, idxs):
        layer_kv = layer_kv.write(k, v, idx)
    return outs, layer_kv


def lm_head(params: ModelParams, x: jax.Array) -> jax.Array:
    """x: [..., D] -> f32 logits [..., V] (tied to the embedding when lm_head is None)."""
    w = params.embed if params.lm_head is None else params.lm_head
    return linear(x, w, preferred_element_type=jnp.float32)


def soft_cap_logits(config: ModelConfig, logits: jax.Array) -> jax.Array:
    """f32[..., V] -> cap * tanh(logits / cap) with `config.final_softcap` (Gemma 2), else as is."""
    cap = config.final_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def forward_groups(
    params: ModelParams, config: ModelConfig, kv: PagedKVState, groups: tuple[TokenGroup, ...],
    attention_impl: str = "reference",
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[tuple[jax.Array, ...], PagedKVState]:
    """Evaluate several token groups in one pass -> (logits per group, updated cache).

    Row b of a group appends its first `num_new[b]` tokens to slot `slots[b]` (at cache
    positions `kv.lengths[slot] ...`) and attends causally over everything that slot has
    cached. Logits per group are f32[B, T, V], or f32[B, V] when `logits_index` is given.
    A row with `num_new[b] == 0` writes nothing and leaves its slot untouched.
    With `kv.streaming`, slots are bounded sink + recent rings and the RoPE positions are
    assigned inside the cache (`positions` is not used). `attention_impl` picks the paged
    attention: the jnp reference, the Pallas kernels, or "auto" (`jaxinfer.attention.dispatch`).
    `mesh`: the ("data", "model") mesh the params and pages are sharded on (`jaxinfer.sharding`);
    the paged writes and attention then run per device, each on its own pages.
    `params.layers` and `kv.layers` must share a layout: both per layer, or both stacked in
    the same runs (`jaxinfer.model.stacking`); each run is one `lax.scan`.
    """
    logits, _, kv = forward_hidden(params, config, kv, groups, attention_impl, mesh)
    return logits, kv


def forward_hidden(
    params: ModelParams, config: ModelConfig, kv: PagedKVState, groups: tuple[TokenGroup, ...],
    attention_impl: str = "reference", mesh: jax.sharding.Mesh | None = None,
    inputs: jax.Array | None = None,  # [N, D]: the first layer's input (flattened groups) instead of embeddings
    taps: tuple[int, ...] = (),
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], PagedKVState]:
    """`forward_groups` that also returns each group's hidden states [B, T, D]: the residual
    stream after the last layer, before the final norm (the features an EAGLE draft head
    reads, `jaxinfer.speculative.eagle`). XLA drops them where the caller does not use them.
    With `taps` (layer indices), the streams after those layers instead, [B, T, len(taps), D]
    (an EAGLE-3 head fuses them); a tap must end a run of scanned layers (`layer_runs`'s
    `split_at`). `inputs` replaces the token embeddings (the EAGLE head feeds its fused features)."""
    if kv.block_tables.shape[0] != kv.lengths.shape[0]:
        raise ValueError(f"kv.block_tables has {kv.block_tables.shape[0]} rows but kv.lengths {kv.lengths.shape[0]}: "
                         "one row per slot (replace both, or keep the table's shape)")
    idxs = [write_indices(kv, g.slots, g.num_new, g.tokens.shape[1]) for g in groups]
    # windowed layers of a hybrid model: their own pool, a ring of pages per slot (`jaxinfer.kv.window_ring`)
    ring_idxs = None if kv.window_tables is None else [ring_indices(i, kv.window_tables, kv.page_size, kv.window_pool_pages)
                                                       for i in idxs]
    idxs = [i if g.shared is None else drop_writes_below(i, g.shared, kv.num_pages) for i, g in zip(idxs, groups)]
    inv_freq = {w: layer_inv_freq(config, w) for w in {None, *config.layer_windows}}  # f32[Dh/2] per window
    if inputs is None:
        inputs = _flat([params.embed[g.tokens] for g in groups])
        if config.embed_scale is not None:  # Gemma: the scale rounded to the weights' dtype, as HF does
            inputs = inputs * jnp.asarray(config.embed_scale, inputs.dtype)
    x = inputs.astype(config.jnp_dtype)  # [N, D]
    mlp = geglu_mlp if config.is_gemma else swiglu_mlp

    def post_norm(h, weight):  # Gemma 2/3 norm the attention and MLP outputs before the residual add
        return h if weight is None else rms_norm(h, weight, config.rms_eps)

    def decoder_layer(x, layer, layer_kv, window):  # [N, D] -> [N, D], the layer's new cache
        layer_idxs = idxs if window is None or ring_idxs is None else ring_idxs
        h, layer_kv = attention_block(config, layer, layer_kv, rms_norm(x, layer.attn_norm, config.rms_eps), groups,
                                      layer_idxs, inv_freq[window], window=window, streaming=kv.streaming,
                                      max_slots=kv.max_slots, attention_impl=attention_impl, mesh=mesh)
        x = x + post_norm(h, getattr(layer, "post_attn_norm", None))
        xn = rms_norm(x, layer.mlp_norm, config.rms_eps)
        h = mlp(xn, layer.w_gate, layer.w_up, layer.w_down) if config.moe is None else moe_mlp(xn, layer, config.moe)
        return x + post_norm(h, getattr(layer, "post_mlp_norm", None)), layer_kv

    caches, tapped = [], []
    for first, layer, layer_kv in _entries(config, params, kv):
        n = layer.n if isinstance(layer, LayerStack) else 1
        if any(first <= t < first + n - 1 for t in taps):
            raise ValueError(f"taps={taps}: a tap inside the scanned run of layers {first}..{first + n - 1}")
        if isinstance(layer, LayerStack):
            x, layer_kv = _scan_run(decoder_layer, x, layer, layer_kv, config.window(first))
        else:
            x, layer_kv = decoder_layer(x, layer, layer_kv, config.window(first))
        caches.append(layer_kv)
        if first + n - 1 in taps:
            tapped.append(x)
    if len(tapped) != len(taps):
        raise ValueError(f"taps={taps} must be distinct layer indices below {config.n_layers}")
    kv = dataclasses.replace(kv, layers=tuple(caches))
    hidden = _split(jnp.stack(tapped, axis=1) if taps else x, groups)
    x = rms_norm(x, params.final_norm, config.rms_eps)

    logits = []
    for g, xg in zip(groups, _split(x, groups)):
        if g.logits_index is not None:
            xg = jnp.take_along_axis(xg, g.logits_index[:, None, None], axis=1)[:, 0]  # [B, D]
        logits.append(soft_cap_logits(config, lm_head(params, xg)))
    lengths = kv.lengths
    for g in groups:
        lengths = lengths.at[g.slots].add(g.num_new)
    return tuple(logits), tuple(hidden), dataclasses.replace(kv, lengths=lengths)


def layer_inv_freq(config: ModelConfig, window: int | None) -> jax.Array:
    """f32[rope_dim / 2]: RoPE frequencies of a layer with this window; windowed layers use
    `rope_local_theta` (unscaled) when the config sets one (Gemma 3: local 10k, global 1M)."""
    rope_dim = config.head_dim if config.mla is None else config.mla.qk_rope_dim
    if window is not None and config.rope_local_theta is not None:
        return rope_inv_freq(rope_dim, config.rope_local_theta, None)
    return rope_inv_freq(rope_dim, config.rope_theta, config.rope_scaling)


def _entries(config: ModelConfig, params: ModelParams, kv: PagedKVState):
    """(index of the first layer, params, cache) per layout entry: a layer, or a run of layers."""
    if run_lengths(params.layers) != run_lengths(kv.layers):
        raise ValueError(f"params and KV cache differ in layer layout (runs {run_lengths(params.layers)} vs "
                         f"{run_lengths(kv.layers)}; 0 = unrolled): stack both alike (`jaxinfer.model.stacking`)")
    first = 0
    for layer, layer_kv in zip(params.layers, kv.layers):
        n = layer.n if isinstance(layer, LayerStack) else 1
        if len({config.window(i) for i in range(first, first + n)}) > 1:
            raise ValueError(f"layers {first}..{first + n - 1} are one run but differ in attention window")
        yield first, layer, layer_kv
        first += n


def _scan_run(decoder_layer, x: jax.Array, run: LayerStack, cache: LayerStack, window: int | None
              ) -> tuple[jax.Array, LayerStack]:
    """`decoder_layer` over a run's layers by `lax.scan`: the params are the scanned input
    (a slice per layer); the stacked caches ride in the carry and each layer writes its own
    layer in place through a view (`jaxinfer.kv.layer_cache`), never a copy of the pool."""
    def body(carry, xs):
        x, pages = carry  # [N, D]; the run's caches, every leaf [n, ...]
        layer, i = xs
        x, view = decoder_layer(x, layer, pages.replace(layer=i), window)
        return (x, view.replace(layer=None)), None

    (x, pages), _ = jax.lax.scan(body, (x, cache.stacked), (run.stacked, jnp.arange(run.n, dtype=jnp.int32)))
    return x, LayerStack(pages)


def forward(
    params: ModelParams,
    config: ModelConfig,
    tokens: jax.Array,  # i32[B, T]; row b appends to slot b
    positions: jax.Array,  # i32[B, T] (or i32[T], the same for every row): RoPE positions of the tokens
    kv: PagedKVState,
    num_new: jax.Array | None = None,  # i32[B]: valid tokens per row (rest is padding)
    logits_index: jax.Array | None = None,  # i32[B]: compute logits only at this position
    attention_impl: str = "reference",  # static: "auto" | "reference" | "pallas"
    mesh: jax.sharding.Mesh | None = None,  # static: the mesh params and cache are sharded on
) -> tuple[jax.Array, PagedKVState]:
    """One group whose row b is slot b: `forward_groups` for the common case; jitted, donates `kv`.

    Returns logits f32[B, T, V] (f32[B, V] with `logits_index`) and the cache holding the
    new K/V with advanced lengths (by `num_new`, clipped to [0, T]).

    The caller owns the block tables: slot b must have pages for `kv.lengths[b] + num_new[b]`
    tokens. Inside jit nothing can raise on values, so a token past the pages it was given
    is not written (`write_indices`) and the logits of later positions are wrong; keep a
    `PageAllocator` (or count `ceil(length / page_size)` pages) per slot. `kv` is donated,
    block tables included: keep your own copy of a table as a numpy array, not a jax array
    that went into `kv` (`forward_groups`, not jitted, donates nothing: jit it your way).

    On a mesh with `data` = D > 1, slot s belongs to replica s // (max_slots / D) and may hold
    only that replica's pages, `jaxinfer.kv.partition_pages(num_pages, D)[replica]`; called
    with concrete block tables (not under your own jit) this is checked here, a ValueError.
    """
    if mesh is not None and mesh.shape.get("data", 1) > 1 and not isinstance(kv.block_tables, jax.core.Tracer):
        check_replica_pages(np.asarray(kv.block_tables), kv.num_pages, mesh.shape["data"])
    return _forward(params, config, tokens, positions, kv, num_new, logits_index, attention_impl=attention_impl,
                    mesh=mesh)


@functools.partial(jax.jit, static_argnames=("config", "attention_impl", "mesh"), donate_argnames=("kv",))
def _forward(params, config, tokens, positions, kv, num_new=None, logits_index=None, attention_impl="reference",
             mesh=None):
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be i32[B, T], got {tokens.dtype}{list(tokens.shape)}")
    b, t = tokens.shape
    if b > kv.max_slots:
        raise ValueError(f"batch size {b} exceeds the cache's max_slots={kv.max_slots}")
    positions = jnp.asarray(positions)
    if positions.shape == (t,):
        positions = jnp.broadcast_to(positions, (b, t))
    num_new = jnp.full((b,), t, jnp.int32) if num_new is None else jnp.asarray(num_new)
    logits_index = None if logits_index is None else jnp.asarray(logits_index)
    for name, a, shape in (("positions", positions, (b, t)), ("num_new", num_new, (b,)),
                           ("logits_index", logits_index, (b,))):
        if a is not None and (a.shape != shape or not jnp.issubdtype(a.dtype, jnp.integer)):
            raise ValueError(f"{name} must be i32{list(shape)} for tokens of shape [B, T] = {[b, t]}, "
                             f"got {a.dtype}{list(a.shape)}")
    num_new = jnp.clip(num_new, 0, t).astype(jnp.int32)  # values cannot raise under jit: clip to the row
    group = TokenGroup(tokens, positions.astype(jnp.int32), jnp.arange(b, dtype=jnp.int32), num_new, logits_index,
                       by_replica=b == kv.max_slots)
    (logits,), kv = forward_groups(params, config, kv, (group,), attention_impl, mesh)
    return logits, kv


forward.lower = _forward.lower  # ahead-of-time lowering, as on a jitted function
