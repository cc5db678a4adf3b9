"""Sampling: user-facing parameters (host) and pure sampling functions over logits (device).

Each row carries its own temperature / top-k / top-p / min-p and seed, so one jitted
program serves a batch that mixes greedy and sampled requests. The random key of a row
is `fold_in(PRNGKey(seed), position)`: the token drawn at a position depends only on the
request's seed, the position and the logits, never on what else shares the batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

NEG_INF = -jnp.inf
MAX_LOGPROBS = 5  # top alternatives every step computes (static: one compiled shape)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. `temperature=0` means greedy (argmax)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None: drawn from the engine's generator
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculative: bool = True  # False: never use draft tokens (when the engine speculates)
    logprobs: int | None = None  # None = off; n: each token's logprob + its n most likely alternatives

    def __post_init__(self) -> None:
        _check(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
               and self.temperature >= 0, f"temperature={self.temperature!r} must be a finite number >= 0")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, f"top_p={self.top_p!r} must be in (0, 1]")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, f"min_p={self.min_p!r} must be in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**32),
               f"seed={self.seed!r} must be None or an integer in [0, 2**32)")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _check(all(isinstance(s, str) and s for s in stop), f"stop={self.stop!r} must be non-empty strings")
        ids = tuple(self.stop_token_ids)
        _check(all(isinstance(i, int) and i >= 0 for i in ids), f"stop_token_ids={self.stop_token_ids!r} must be integers >= 0")
        _check(isinstance(self.speculative, bool), f"speculative={self.speculative!r} must be a bool")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs={self.logprobs!r} must be None or an integer in [0, {MAX_LOGPROBS}]")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@struct.dataclass
class SamplingArrays:
    """Per-row sampling parameters as device arrays (one row per batch slot)."""

    temperature: jax.Array  # f32[B]; 0 = greedy
    top_k: jax.Array  # i32[B]; 0 = off
    top_p: jax.Array  # f32[B]; 1 = off
    min_p: jax.Array  # f32[B]; 0 = off
    seed: jax.Array  # u32[B]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int]) -> SamplingArrays:
        return cls(  # numpy leaves: converted when they enter a jitted function
            temperature=np.asarray([p.temperature for p in params], np.float32),
            top_k=np.asarray([p.top_k for p in params], np.int32),
            top_p=np.asarray([p.top_p for p in params], np.float32),
            min_p=np.asarray([p.min_p for p in params], np.float32),
            seed=np.asarray(seeds, np.uint32),
        )


def filter_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Temperature, then top-k, top-p and min-p as masks: f32[B, V] -> f32[B, V].

    Disallowed tokens get -inf; `softmax` of the result is the distribution sampled from
    (the target distribution `p` that speculative verification must preserve). Greedy
    rows (temperature 0) are left at temperature 1; `sample_tokens` takes their argmax.
    Top-p keeps the smallest set of most likely tokens whose mass reaches `top_p` after
    top-k; min-p keeps tokens with probability >= min_p * max probability.
    """
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)
    x = logits.astype(jnp.float32) / temperature[:, None]
    vocab = x.shape[-1]
    # The sort below costs more than the rest of sampling: skip it when no row filters.
    filters = ((s.top_k > 0) & (s.top_k < vocab)) | (s.top_p < 1) | (s.min_p > 0)
    return jax.lax.cond(jnp.any(filters), _top_k_top_p_min_p, lambda x, s: x, x, s)


def _top_k_top_p_min_p(x: jax.Array, s: SamplingArrays) -> jax.Array:
    """`filter_logits` after temperature: x f32[B, V] -> f32[B, V] with -inf outside each row's set."""
    vocab = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)  # [B, V], largest first

    k = jnp.where((s.top_k > 0) & (s.top_k < vocab), s.top_k, vocab)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    desc = jnp.where(desc >= kth, desc, NEG_INF)

    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = (mass_before < s.top_p[:, None]) | (jnp.arange(vocab) == 0)  # top-1 always kept
    pth = jnp.min(jnp.where(kept, desc, jnp.inf), axis=-1, keepdims=True)

    min_p_th = desc[:, :1] + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None]
    threshold = jnp.maximum(jnp.maximum(kth, pth), jnp.where(s.min_p[:, None] > 0, min_p_th, NEG_INF))
    return jnp.where(x >= threshold, x, NEG_INF)


@struct.dataclass
class TokenLogprobs:
    """Log-probabilities of emitted tokens and their top alternatives, for any leading shape [...]."""

    logprob: jax.Array  # f32[...]: the emitted token's
    top_ids: jax.Array  # i32[..., MAX_LOGPROBS]: most likely tokens, most likely first
    top_logprobs: jax.Array  # f32[..., MAX_LOGPROBS]: their logprobs, descending


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """f32[..., V], i32[...] -> TokenLogprobs[...] of the model's raw distribution.

    vLLM's convention: `log_softmax` of the raw logits, before temperature, top-k, top-p
    and min-p, so a token's logprob does not depend on how it was sampled (a greedy and a
    sampled request report the same numbers for the same context).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    return TokenLogprobs(logprob=chosen, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)


def row_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    """One PRNG key per row from its seed u32[B] and the position i32[B] being sampled."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)


def sample_tokens(logits: jax.Array, s: SamplingArrays, position: jax.Array) -> jax.Array:
    """Draw one token per row: f32[B, V] -> i32[B]. Greedy rows take the argmax.

    When every row is greedy the sort behind top-k/top-p is skipped entirely.
    """

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        filtered = filter_logits(logits, s)
        drawn = jax.vmap(jax.random.categorical)(row_keys(s.seed, position), filtered)
        return jnp.where(s.temperature > 0, drawn, greedy(None)).astype(jnp.int32)

    return jax.lax.cond(jnp.all(s.temperature == 0), greedy, sampled, None)
