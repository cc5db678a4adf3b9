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

from jaxinfer.structured_output import StructuredOutputsParams

NEG_INF = -jnp.inf
MAX_LOGPROBS = 20  # top alternatives the logprob program computes (static: one compiled shape; vLLM's default cap)
# Top-k up to this many tokens finds its cut with a partial top-k: on XLA:CPU sorting a
# 49,152-wide row costs ~15 ms, `lax.top_k(row, 256)` under 1 ms (BENCHMARKS.md, issue 18).
FAST_TOP_K = 256
INT32_MAX = 2**31 - 1  # top_k and max_tokens are packed into int32 arrays / compared with int32 positions
# Positive temperatures below this sample greedily (vLLM's convention): logits / T would
# overflow float32 to inf (and softmax to NaN) long before T reaches float32's smallest normal.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0  # beyond it every distribution is uniform to float32 precision
# Each generated token is checked against every stop string / id on the engine thread, so a
# request with thousands of them would slow every other request: they are capped.
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries of `logit_bias` (OpenAI allows 300)
MAX_BAD_WORDS = 1024


OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # `SamplingParams.output_kind`


@dataclasses.dataclass(frozen=True, kw_only=True)  # keywords only: fields may be added anywhere
class SamplingParams:
    """How to pick each next token. `temperature=0` means greedy (argmax); so does a positive
    temperature below `MIN_TEMPERATURE` (it is stored as 0). Out-of-range values raise
    ValueError naming the field; `top_k` at or above the vocabulary keeps every token."""

    # samples of the prompt: `Engine.generate` / `chat` return them as `RequestOutput.outputs`
    # (sample i seeded with seed + i, given a seed); `add_request` takes one sample per request
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 = off (so is -1, vLLM's "off", stored as 0)
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None: drawn from the engine's generator
    max_tokens: int | None = 256  # None: as many as the context leaves (the engine fills it in); vLLM's default is 16
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); None keeps it whole
    truncate_prompt_tokens: int | None = None
    # EOS and stop_token_ids cannot be sampled, nor stop strings end the request, before this
    # many tokens are generated (vLLM's)
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # stop strings (not in the output unless include_stop_str_in_output)
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculative: bool = True  # False: never use draft tokens (when the engine speculates)
    # Penalties and bias on the raw logits (`jaxinfer.penalties`)
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages every token of the prompt and output (HF)
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus f x times the token appeared in the output
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus p once the token appeared in the output
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] = ()  # {token id: added to its logit, in [-100, 100]}
    allowed_token_ids: Sequence[int] | None = None  # vLLM's: sample only among these ids (None: all)
    bad_words: tuple[str, ...] = ()  # vLLM's: words the output never holds (`jaxinfer.bad_words`)
    # Sample only what a JSON schema / regex / choice / grammar allows (`jaxinfer.structured_output`)
    structured_outputs: StructuredOutputsParams | None = None
    logprobs: int | None = None  # None = off; n: each token's logprob + its n most likely alternatives
    # vLLM's: the same for every prompt token (the first has none), scored at `add_request` by
    # one teacher-forced forward of the prompt (`jaxinfer.scoring.score_tokens`)
    prompt_logprobs: int | None = None
    # False: special tokens (<|im_start|>, <tool_call> where it is one) appear in the text; the
    # EOS or stop token that ends the request only with include_stop_str_in_output (as in vLLM)
    skip_special_tokens: bool = True
    # What each `RequestOutput` of the request holds (vLLM's RequestOutputKind): "cumulative"
    # (everything so far), "delta" (token_ids / text / logprobs: only what is new since the
    # last output) or "final_only" (no output until it finishes, then everything). The last
    # two spare the host a copy of the whole output per token.
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        """Range-check every field, so a request that passes can always be packed into a
        step's arrays (`SamplingArrays`): f32 temperature/top_p/min_p, i32 top_k, u32 seed."""
        _check(_is_int(self.n) and 1 <= self.n <= INT32_MAX, f"n={self.n!r} must be a positive integer")
        _check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                       and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)),
               f"truncate_prompt_tokens={self.truncate_prompt_tokens!r} must be None, -1 (the context) or a positive integer")
        _check(_is_real(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
               f"temperature={self.temperature!r} must be a finite number in [0, {MAX_TEMPERATURE:g}]")
        _check(_is_int(self.top_k) and -1 <= self.top_k <= INT32_MAX,
               f"top_k={self.top_k!r} must be an integer in [-1, 2**31 - 1] (0 or -1 disables it; above the "
               "vocabulary it keeps every token)")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p={self.top_p!r} must be in (0, 1]")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p={self.min_p!r} must be in [0, 1]")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**32),
               f"seed={self.seed!r} must be None or an integer in [0, 2**32)")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX),
               f"max_tokens={self.max_tokens!r} must be None or an integer in [1, 2**31 - 1]")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or INT32_MAX),
               f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens={self.max_tokens!r}]")
        _check(isinstance(self.include_stop_str_in_output, bool),
               f"include_stop_str_in_output={self.include_stop_str_in_output!r} must be a bool")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _check(all(isinstance(s, str) and s for s in stop) and len(stop) <= MAX_STOP_STRINGS,
               f"stop={self.stop!r} must be at most {MAX_STOP_STRINGS} non-empty strings")
        bad_words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        _check(all(isinstance(w, str) and w.strip() for w in bad_words) and len(bad_words) <= MAX_BAD_WORDS,
               f"bad_words={self.bad_words!r} must be at most {MAX_BAD_WORDS} strings that are not blank")
        ids = tuple(self.stop_token_ids)
        _check(all(_is_int(i) and 0 <= i <= INT32_MAX for i in ids) and len(ids) <= MAX_STOP_TOKEN_IDS,
               f"stop_token_ids={self.stop_token_ids!r} must be at most {MAX_STOP_TOKEN_IDS} integers in [0, 2**31 - 1]")
        for name in ("speculative", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be a bool")
        _check(_is_real(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_TEMPERATURE,
               f"repetition_penalty={self.repetition_penalty!r} must be a number in (0, {MAX_TEMPERATURE:g}] (1 = off)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, f"{name}={value!r} must be a number in [-2, 2]")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((token, value) for token, value in bias))
        except (TypeError, ValueError):
            bias = None
        allowed = self.allowed_token_ids
        if allowed is not None:
            try:
                allowed = tuple(sorted(set(allowed)))
            except TypeError:
                allowed = ()
            _check(bool(allowed) and all(_is_int(t) and 0 <= t <= INT32_MAX for t in allowed),
                   f"allowed_token_ids must be None or a non-empty list of token ids, got {str(self.allowed_token_ids)[:200]}")
            object.__setattr__(self, "allowed_token_ids", allowed)
        _check(bias is not None and len(bias) <= MAX_LOGIT_BIAS
               and all(_is_int(t) and 0 <= t <= INT32_MAX and _is_real(v) and -100 <= v <= 100 for t, v in bias)
               and len({t for t, _ in bias}) == len(bias),
               f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100], got {str(self.logit_bias)[:200]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                   f"{name}={value!r} must be None or an integer in [0, {MAX_LOGPROBS}]")
        structured = self.structured_outputs
        if isinstance(structured, dict):  # the JSON-shaped form
            structured = StructuredOutputsParams.from_dict(structured)
        _check(structured is None or isinstance(structured, StructuredOutputsParams),
               f"structured_outputs={structured!r} must be None or a StructuredOutputsParams")
        _check(self.output_kind in OUTPUT_KINDS, f"output_kind={self.output_kind!r} must be one of {OUTPUT_KINDS}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "bad_words", bad_words)
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "structured_outputs", structured)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """The request changes its logits before sampling (penalties, bias, allowed ids, bad
        words, min_tokens or a structured-output grammar): its steps run the programs that do."""
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.structured_outputs is not None
                or self.allowed_token_ids is not None or bool(self.bad_words))


def truncate_prompt(prompt: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: `max_model_len`);
    None keeps it whole."""
    keep = max_model_len if keep == -1 else keep
    return prompt if keep is None or len(prompt) <= keep else prompt[-keep:]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    """A finite int or float (NaN and inf fail every range check's intent, not its comparisons)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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
    top-k; min-p keeps tokens with probability >= min_p * max probability. Tokens tied
    with the last one kept are kept too. Nothing sorts the vocabulary.
    """
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)
    x = logits.astype(jnp.float32) / temperature[:, None]
    vocab = x.shape[-1]
    # min-p needs only the row's max; small top-k a partial top-k; top-p and large top-k a
    # threshold search over the whole row: each runs only when some row of the batch asks.
    min_p_th = jnp.max(x, axis=-1, keepdims=True) + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None]  # [B, 1]
    threshold = jnp.where(s.min_p[:, None] > 0, min_p_th, NEG_INF)
    top_k = (s.top_k > 0) & (s.top_k < vocab)
    searches = (s.top_p < 1) | (top_k & (s.top_k > FAST_TOP_K))
    cut = jax.lax.switch(jnp.where(jnp.any(searches), 2, jnp.where(jnp.any(top_k), 1, 0)),
                         [lambda x, s: jnp.full_like(threshold, NEG_INF), _top_k_threshold, _top_k_top_p_threshold], x, s)
    threshold = jnp.maximum(threshold, cut)
    return jnp.where(x >= threshold, x, NEG_INF)


def _top_k_threshold(x: jax.Array, s: SamplingArrays) -> jax.Array:
    """The k-th largest logit of each top-k row by a partial top-k, for batches whose rows
    keep at most FAST_TOP_K tokens (or are not cut): x f32[B, V] -> f32[B, 1] (-inf where the
    row keeps every token)."""
    vocab = x.shape[-1]
    top = jax.lax.top_k(x, min(FAST_TOP_K, vocab))[0]  # [B, FAST_TOP_K], largest first
    on = (s.top_k > 0) & (s.top_k < vocab)
    kth = jnp.take_along_axis(top, jnp.clip(s.top_k - 1, 0, top.shape[-1] - 1)[:, None], axis=-1)
    return jnp.where(on[:, None], kth, NEG_INF)


def _top_k_top_p_threshold(x: jax.Array, s: SamplingArrays) -> jax.Array:
    """The smallest logit each row's top-k and top-p keep: x f32[B, V] (after temperature)
    -> f32[B, 1] (-inf where the row keeps every token).

    Top-k's cut is the largest logit t with at least k logits >= t (the k-th largest); top-p's
    is the largest t whose tokens >= t hold at least `top_p` of the mass left by top-k: the
    last token a descending cumulative sum would keep. Both are found by `_largest_reaching`
    (32 masked sums over the row; top-k by `_top_k_threshold` when no k exceeds FAST_TOP_K)
    instead of a sort: on XLA:CPU sorting one 49,152-wide row costs ~15 ms, and a 262k-wide
    one (Gemma 3) far more.
    """
    vocab = x.shape[-1]
    on_k = (s.top_k > 0) & (s.top_k < vocab)

    def search_k(x, s):  # some row keeps more than FAST_TOP_K tokens
        kth = _largest_reaching(x, jnp.ones_like(x), jnp.where(on_k, s.top_k, 1).astype(jnp.float32))
        return jnp.where(on_k[:, None], kth, NEG_INF)

    kth = jax.lax.cond(jnp.any(on_k & (s.top_k > FAST_TOP_K)), search_k, _top_k_threshold, x, s)
    probs = jax.nn.softmax(jnp.where(x >= kth, x, NEG_INF), axis=-1)
    pth = _largest_reaching(x, probs, s.top_p)
    # top_p = 1 keeps every token: in float32 a row's mass may sum to just under 1.0
    pth = jnp.where(s.top_p[:, None] < 1, pth, NEG_INF)
    return jnp.maximum(kth, pth)


def _largest_reaching(x: jax.Array, weights: jax.Array, goal: jax.Array) -> jax.Array:
    """Per row, the largest float t such that weights summed over {x >= t} reach `goal`:
    x f32[B, V] (no NaN), weights f32[B, V] >= 0, goal f32[B] -> f32[B, 1], a value of x.

    Bisection over float32's order: an order-preserving map to uint32 keys makes the search
    space 2**32 values, so 32 halvings find t exactly. A row whose whole mass falls short of
    `goal` (float rounding) gets its minimum: it keeps every token.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    keys = jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))  # u32[B, V], ordered as x
    goal = goal[:, None]

    def halve(_, bounds):  # lo reaches the goal (or is the row's minimum: then lo never moves); hi + 1 does not
        lo, hi = bounds
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)  # upper middle, without overflow
        reached = jnp.sum(jnp.where(keys >= mid, weights, 0.0), axis=-1, keepdims=True) >= goal
        return jnp.where(reached, mid, lo), jnp.where(reached, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (keys.min(axis=-1, keepdims=True), keys.max(axis=-1, keepdims=True)))
    bits = jnp.where(lo >> 31 == 1, lo & jnp.uint32(INT32_MAX), ~lo)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@struct.dataclass
class TokenLogprobs:
    """Log-probabilities of emitted tokens and their top alternatives, for any leading shape [...]."""

    logprob: jax.Array  # f32[...]: the emitted token's
    top_ids: jax.Array  # i32[..., MAX_LOGPROBS]: most likely tokens, most likely first
    top_logprobs: jax.Array  # f32[..., MAX_LOGPROBS]: their logprobs, descending
    rank: jax.Array  # i32[...]: 1 + the tokens more likely than the emitted one (vLLM's rank)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """f32[..., V], i32[...] -> TokenLogprobs[...] of the model's raw distribution.

    vLLM's convention: `log_softmax` of the raw logits, before temperature, top-k, top-p
    and min-p, so a token's logprob does not depend on how it was sampled (a greedy and a
    sampled request report the same numbers for the same context).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    rank = 1 + jnp.sum(logp > chosen[..., None], axis=-1, dtype=jnp.int32)
    return TokenLogprobs(logprob=chosen, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs, rank=rank)


def row_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    """One PRNG key per row from its seed u32[B] and the position i32[B] being sampled."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (the first index of the maximum; NaN counts as the
    maximum) as two plain reductions -> i32[...]. XLA:CPU's (value, index) reduce behind
    `argmax` takes 1.6-3x as long over 49,152-wide rows (BENCHMARKS.md, issue 22)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = (logits == top) | jnp.isnan(logits)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def sample_tokens(logits: jax.Array, s: SamplingArrays, position: jax.Array) -> jax.Array:
    """Draw one token per row: f32[B, V] -> i32[B]. Greedy rows take the argmax.

    When every row is greedy the filtering (top-k, top-p, min-p) is skipped entirely.
    """

    def greedy(_):
        return greedy_tokens(logits)

    def sampled(_):
        filtered = filter_logits(logits, s)
        drawn = jax.vmap(jax.random.categorical)(row_keys(s.seed, position), filtered)
        return jnp.where(s.temperature > 0, drawn, greedy(None)).astype(jnp.int32)

    return jax.lax.cond(jnp.all(s.temperature == 0), greedy, sampled, None)
