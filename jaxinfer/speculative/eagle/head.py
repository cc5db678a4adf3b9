"""The EAGLE draft head: one decoder layer over the target's own features.

At pair position i the head reads the target's feature f_i (its residual stream after
the last layer, before the final norm: `jaxinfer.model.forward_hidden`) and the
embedding of the token x_{i+1} that follows, and predicts the next feature f_{i+1}::

    x_i   = fc([rms_norm(embed(x_{i+1})), rms_norm(f_i)])          fc: [D, 2D]
    f'_{i+1} = decoder_layer(x_i | the head's own paged KV at positions <= i)
    logits = rms_norm(f'_{i+1}) @ embed[vocab_ids].T                the target's head, over a subset

With `feature_layers` (EAGLE-3's fusion), f_i is not the last layer's stream but
`fuse([rms_norm(h_i^a), rms_norm(h_i^b), ...])`, fuse: [D, nD], over the residual streams
after target layers a, b, ... (a low, a middle and a high one): the lower layers still hold
what the last one has already turned into its next-token guess.

Drafting feeds its own predictions back: the pair (f'_{i+1}, d_{i+2}) at position i + 1
drafts the token after d_{i+2}, and so on (EAGLE, Li et al. 2024). The head never sees its
own mistakes at training unless it is trained on them, which is what EAGLE-3's
"training-time test" does (`jaxinfer.speculative.train.eagle`).

The head shares the target's embedding, tokenizer and (cut to `vocab_ids`, FR-Spec) LM
head; only `EagleParams` are trained and stored.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig
from jaxinfer.layer_stack import slice_layers, unstack
from jaxinfer.loading import Model
from jaxinfer.model.layers import linear, rms_norm
from jaxinfer.model.params import LayerParams, lm_head_weight


@struct.dataclass
class EagleParams:
    """What an EAGLE head trains (D = the target's d_model)."""

    embed_norm: jax.Array  # f32[D]: RMS-norm weight of the next token's embedding
    feature_norm: jax.Array  # f32[D]: RMS-norm weight of the feature (its scale differs from embeddings')
    fc: jax.Array  # f32[D, 2D]: fuses [embedding, feature] into the layer's input ([out, in] layout)
    layer: LayerParams  # one decoder layer at the target's shapes
    final_norm: jax.Array  # f32[D]: before the (frozen) LM head
    # EAGLE-3 fusion of the streams after target layers `feature_layers` (n of them); with
    # none, the head reads the last layer's stream as it is
    tap_norms: jax.Array | None = None  # f32[n, D]: RMS-norm weight of each tapped layer's stream
    fuse: jax.Array | None = None  # f32[D, nD]: the normed streams, concatenated -> one feature
    feature_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())  # static: part of the tree's shape


@dataclasses.dataclass(frozen=True)
class EagleHead:
    """A trained head bound to its target: `params` plus the frozen parts it borrows.

    `config` is the target's with one layer (the head's paged KV is allocated from it);
    `lm_head` is the target's head rows `vocab_ids` (f32[Vd, D]); `embed` the target's
    embedding (the same array, not a copy)."""

    config: ModelConfig
    params: EagleParams
    vocab_ids: np.ndarray  # i32[Vd]: target token id of each head logit
    embed: jax.Array  # [V, D]
    lm_head: jax.Array  # [Vd, D]
    name: str = "eagle"

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.params.feature_layers


def head_config(target_config: ModelConfig) -> ModelConfig:
    """The head's config: the target's shapes with one full-attention layer."""
    return target_config.replace(n_layers=1, layer_windows=())


def default_feature_layers(n_layers: int) -> tuple[int, ...]:
    """A low, a middle and the last layer (EAGLE-3 fuses three; for SmolLM2's 30: (2, 15, 29))."""
    return tuple(sorted({min(2, n_layers - 1), n_layers // 2, n_layers - 1}))


def check_feature_layers(feature_layers: tuple[int, ...], n_layers: int) -> tuple[int, ...]:
    layers = tuple(feature_layers)
    if not all(isinstance(i, int) and 0 <= i < n_layers for i in layers) or list(layers) != sorted(set(layers)):
        raise ValueError(f"feature_layers={layers!r} must be increasing layer indices in [0, {n_layers})")
    return layers


def target_features(params: EagleParams, taps: jax.Array, eps: float) -> jax.Array:
    """The feature the head reads at each position: the target's tapped streams f[..., n, D]
    fused (EAGLE-3) -> f32[..., D]; a head without fusion reads the last layer's [..., D] as is."""
    if params.fuse is None:
        return taps
    normed = rms_norm(taps.astype(jnp.float32), params.tap_norms, eps)  # [..., n, D]
    return linear(normed.reshape(*taps.shape[:-2], -1), params.fuse)


def head_inputs(params: EagleParams, embed: jax.Array, tokens: jax.Array, features: jax.Array, eps: float) -> jax.Array:
    """The layer's input at each pair: tokens i32[...], features f[..., D] -> f32[..., D]."""
    e = rms_norm(embed[tokens].astype(jnp.float32), params.embed_norm, eps)
    f = rms_norm(features.astype(jnp.float32), params.feature_norm, eps)
    return linear(jnp.concatenate([e, f], axis=-1), params.fc)


def init_eagle_params(target: Model, seed: int = 0, feature_layers: tuple[int, ...] = ()) -> EagleParams:
    """A starting point for training: the target's first layer (it already reads token
    embeddings), fc passing the embedding through plus a small random read of the feature,
    and the target's final norm before the head. (Starting from its last layer with the
    feature passed through instead learned slower: held-out agreement 0.14 vs 0.20 after
    the same 45 steps on 128 sequences.) With `feature_layers`, the fusion starts as the
    last tapped layer passed through plus small random reads of the others."""
    tc, tp = target.config, target.params
    d, n = tc.d_model, len(check_feature_layers(feature_layers, tc.n_layers))
    rng = np.random.default_rng(seed)
    fc = np.concatenate([np.eye(d), 0.02 * rng.standard_normal((d, d))], axis=1).astype(np.float32)  # [D, 2D]
    first = unstack(slice_layers(tp.layers, 0, 1))[0]
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    fusion = {}
    if n:
        fuse = np.concatenate([0.02 * rng.standard_normal((d, d)) for _ in range(n - 1)] + [np.eye(d)], axis=1)
        fusion = dict(tap_norms=jnp.ones((n, d), jnp.float32), fuse=f32(fuse), feature_layers=tuple(feature_layers))
    return EagleParams(embed_norm=jnp.ones((d,), jnp.float32), feature_norm=jnp.ones((d,), jnp.float32),
                       fc=jnp.asarray(fc), layer=jax.tree.map(f32, first), final_norm=f32(tp.final_norm), **fusion)


def bind_head(target: Model, params: EagleParams, vocab_ids: np.ndarray, name: str = "eagle") -> EagleHead:
    """An `EagleHead` for `target` from trained params and its vocabulary subset (in the target's dtype)."""
    tc, tp = target.config, target.params
    layers = check_feature_layers(params.feature_layers, tc.n_layers)
    if (params.fuse is None) != (not layers) or (layers and params.fuse.shape != (tc.d_model, len(layers) * tc.d_model)):
        raise ValueError(f"the head's fusion weights do not match feature_layers={layers!r}")
    ids = np.asarray(vocab_ids, np.int32)
    if ids.ndim != 1 or len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= tc.vocab_size:
        raise ValueError(f"vocab_ids must be distinct token ids in [0, {tc.vocab_size})")
    if tc.mla is not None:
        raise ValueError("an EAGLE head for an MLA target is not supported")
    head = lm_head_weight(tp)
    dtype = tc.jnp_dtype
    return EagleHead(config=head_config(tc), params=jax.tree.map(lambda a: jnp.asarray(a, dtype), params),
                     vocab_ids=ids, embed=tp.embed, lm_head=jnp.asarray(head[ids]), name=name)
