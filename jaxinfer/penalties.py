"""Repetition, frequency and presence penalties, logit bias and min_tokens, applied before sampling.

What a request asks for (`SamplingParams`), with vLLM's and the OpenAI API's meaning:

- `logit_bias` {token: b}: b is added to the token's logit (b in [-100, 100]);
- `allowed_token_ids` (vLLM's): every other token's logit is -inf (a bias of -inf);
- `repetition_penalty` r (HF transformers, CTRL): the logit of every token that appeared in
  the prompt or the output so far is divided by r when positive, multiplied by r otherwise;
- `frequency_penalty` f and `presence_penalty` p (OpenAI): a token's logit loses
  f * (times it appeared in the output) + p * (1 if it appeared in the output at all);

in that order (vLLM's), on the raw logits, before temperature and the top-k / top-p / min-p
filters; and `min_tokens` n (vLLM's): until n tokens have been generated, the tokens that
would stop the request (EOS unless `ignore_eos`, `stop_token_ids`) cannot be sampled.
Logprobs stay those of the raw logits, as vLLM reports them by default.

The penalties need each request's token history. It lives on the device as a
`PenaltyState` of dense per-slot rows, so a step reads and updates it without a per-step
transfer: when a request takes a slot, the host writes the slot's row once (`set_slot`:
bias, prompt tokens, output tokens so far, which after a preemption are not empty); after
that each decode step counts the token it feeds (`count_fed`) before it penalizes the row's
logits. A speculative block scores position j as if the drafts before it were accepted
(`penalize_block`) and counts what it kept. Prefix-cache hits and recomputation change
nothing: the history comes from the host. Steps that serve no penalized request run
programs without any of this.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.sampling import SamplingParams


@struct.dataclass
class PenaltyState:
    """Per-slot token history and penalty parameters (S = max_slots, V = vocabulary)."""

    output_counts: jax.Array  # i32[S, V]: times each token appeared in the slot's output so far
    in_prompt: jax.Array  # bool[S, V]: the token appears in the slot's prompt
    logit_bias: jax.Array  # f32[S, V]: added to the logits
    repetition: jax.Array  # f32[S]: 1 = off
    frequency: jax.Array  # f32[S]: 0 = off
    presence: jax.Array  # f32[S]: 0 = off
    stop_ids: jax.Array  # bool[S, V]: the tokens that would stop the slot's request
    min_end: jax.Array  # i32[S]: stop_ids cannot be sampled at cache positions before this (min_tokens)
    # i32[S]: tokens of the slot's sequence already in its row (`set_slot`); a decode step
    # counts the token it feeds only at positions from here on
    counted: jax.Array


def init_penalty_state(max_slots: int, vocab: int) -> PenaltyState:
    """Every slot neutral: no history, no bias, no penalty."""
    return PenaltyState(
        output_counts=jnp.zeros((max_slots, vocab), jnp.int32), in_prompt=jnp.zeros((max_slots, vocab), bool),
        logit_bias=jnp.zeros((max_slots, vocab), jnp.float32), repetition=jnp.ones((max_slots,), jnp.float32),
        frequency=jnp.zeros((max_slots,), jnp.float32), presence=jnp.zeros((max_slots,), jnp.float32),
        stop_ids=jnp.zeros((max_slots, vocab), bool), min_end=jnp.zeros((max_slots,), jnp.int32),
        counted=jnp.zeros((max_slots,), jnp.int32))


@struct.dataclass
class SlotHistory:
    """One slot's row of a `PenaltyState`, built on the host (`slot_history`)."""

    output_counts: np.ndarray  # i32[V]
    in_prompt: np.ndarray  # bool[V]
    logit_bias: np.ndarray  # f32[V]
    factors: np.ndarray  # f32[3]: repetition, frequency, presence
    stop_ids: np.ndarray  # bool[V]
    min_end: np.ndarray  # i32[]
    counted: np.ndarray  # i32[]: prompt + output tokens counted


def slot_history(vocab: int, prompt: Sequence[int], output: Sequence[int], params: SamplingParams | None = None,
                 eos_ids: Sequence[int] = ()) -> SlotHistory:
    """The row of a request with `params` whose sequence so far is `prompt` + `output`
    (neutral without params); `eos_ids` stop it unless it ignores EOS."""
    params = params or SamplingParams()
    bias = np.zeros(vocab, np.float32)
    for token, value in params.logit_bias:
        bias[token] = value
    if params.allowed_token_ids is not None:  # every other token's logit becomes -inf
        allowed = np.asarray(params.allowed_token_ids, np.int64)
        kept = bias[allowed]
        bias = np.full(vocab, -np.inf, np.float32)
        bias[allowed] = kept
    in_prompt = np.zeros(vocab, bool)
    in_prompt[np.asarray(prompt, np.int64)] = True
    stops = [t for t in (*params.stop_token_ids, *(() if params.ignore_eos else eos_ids)) if t < vocab]
    stop_ids = np.zeros(vocab, bool)
    stop_ids[np.asarray(stops, np.int64)] = True
    factors = [params.repetition_penalty, params.frequency_penalty, params.presence_penalty]
    return SlotHistory(output_counts=np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(np.int32),
                       in_prompt=in_prompt, logit_bias=bias, factors=np.asarray(factors, np.float32),
                       stop_ids=stop_ids, min_end=np.asarray(len(prompt) + params.min_tokens, np.int32),
                       counted=np.asarray(len(prompt) + len(output), np.int32))


@functools.partial(jax.jit, donate_argnums=0)
def set_slot(state: PenaltyState, slot: jax.Array, row: SlotHistory) -> PenaltyState:
    """Write slot `slot` (i32[]) of the state: a request took it."""
    return PenaltyState(
        output_counts=state.output_counts.at[slot].set(row.output_counts),
        in_prompt=state.in_prompt.at[slot].set(row.in_prompt), logit_bias=state.logit_bias.at[slot].set(row.logit_bias),
        repetition=state.repetition.at[slot].set(row.factors[0]), frequency=state.frequency.at[slot].set(row.factors[1]),
        presence=state.presence.at[slot].set(row.factors[2]), stop_ids=state.stop_ids.at[slot].set(row.stop_ids),
        min_end=state.min_end.at[slot].set(row.min_end), counted=state.counted.at[slot].set(row.counted))


def count_fed(state: PenaltyState, slots: jax.Array, tokens: jax.Array, positions: jax.Array,
              keep: jax.Array) -> PenaltyState:
    """Count the tokens each decode row fed (and keeps: a speculative block keeps its pending
    token and the accepted drafts), where they are output tokens the host has not counted:
    slots i32[R]; tokens, positions i32[R, T]; keep bool[R, T]."""
    new = keep & (positions >= state.counted[slots][:, None])
    index = jnp.where(new, slots[:, None], state.counted.shape[0])  # out of range: dropped
    return state.replace(output_counts=state.output_counts.at[index, tokens].add(1, mode="drop"))


def penalize(logits: jax.Array, state: PenaltyState, slots: jax.Array, positions: jax.Array,
             counts: jax.Array | None = None) -> jax.Array:
    """Bias, then repetition, frequency and presence penalties, then min_tokens: logits
    f32[R, V] of rows continuing `slots` i32[R], sampling the token of cache position
    `positions` i32[R] -> f32[R, V]. `counts` i32[R, V]: the rows' output counts, when not
    the slots' (`penalize_block`). Neutral rows come back unchanged."""
    counts = state.output_counts[slots] if counts is None else counts  # i32[R, V]
    in_output = counts > 0
    x = logits.astype(jnp.float32) + state.logit_bias[slots]
    r = state.repetition[slots][:, None]
    x = jnp.where(state.in_prompt[slots] | in_output, jnp.where(x > 0, x / r, x * r), x)
    x = x - state.frequency[slots][:, None] * counts - state.presence[slots][:, None] * in_output
    too_early = (positions < state.min_end[slots])[:, None]  # fewer than min_tokens generated before it
    return jnp.where(too_early & state.stop_ids[slots], -jnp.inf, x)


def penalize_block(logits: jax.Array, state: PenaltyState, slots: jax.Array, tokens: jax.Array,
                   positions: jax.Array, active: jax.Array) -> jax.Array:
    """`penalize` at every position of speculative blocks: logits f32[R, T, V] after row r
    fed tokens[r, : j + 1] (i32[R, T], at cache positions `positions` i32[R, T]) -> f32[R, T, V].

    Position j is scored as if the drafts before it were accepted (it only emits when they
    are), so its counts include every token fed up to it that the history lacks."""
    r, t, v = logits.shape
    new = active[:, None] & (positions >= state.counted[slots][:, None])  # bool[R, T]
    fed = jax.nn.one_hot(tokens, v, dtype=jnp.int32) * new[..., None]  # i32[R, T, V]
    counts = state.output_counts[slots][:, None] + jnp.cumsum(fed, axis=1)  # i32[R, T, V]
    flat = penalize(logits.reshape(r * t, v), state, jnp.repeat(slots, t), (positions + 1).reshape(-1),
                    counts.reshape(r * t, v))
    return flat.reshape(r, t, v)
