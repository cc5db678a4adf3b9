"""Repetition, frequency and presence penalties and logit bias, applied before sampling.

What a request asks for (`SamplingParams`), with vLLM's and the OpenAI API's meaning:

- `logit_bias` {token: b}: b is added to the token's logit (b in [-100, 100]);
- `repetition_penalty` r (HF transformers, CTRL): the logit of every token that appeared in
  the prompt or the output so far is divided by r when positive, multiplied by r otherwise;
- `frequency_penalty` f and `presence_penalty` p (OpenAI): a token's logit loses
  f * (times it appeared in the output) + p * (1 if it appeared in the output at all);

in that order (vLLM's), on the raw logits, before temperature and the top-k / top-p / min-p
filters. Logprobs stay those of the raw logits, as vLLM reports them by default.

The penalties need each request's token history. It lives on the device as a
`PenaltyState` of dense per-slot rows, so a step reads and updates it without a per-step
transfer: when a request takes a slot, the host writes the slot's row once (`set_slot`:
bias, prompt tokens, output tokens so far, which after a preemption are not empty); after
that each decode step counts the token it feeds (`count_fed`) before it penalizes the row's
logits. Prefix-cache hits and recomputation change nothing: the history comes from the
host. Steps that serve no penalized request run programs without any of this.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class PenaltyState:
    """Per-slot token history and penalty parameters (S = max_slots, V = vocabulary)."""

    output_counts: jax.Array  # i32[S, V]: times each token appeared in the slot's output so far
    in_prompt: jax.Array  # bool[S, V]: the token appears in the slot's prompt
    logit_bias: jax.Array  # f32[S, V]: added to the logits
    repetition: jax.Array  # f32[S]: 1 = off
    frequency: jax.Array  # f32[S]: 0 = off
    presence: jax.Array  # f32[S]: 0 = off
    # i32[S]: tokens of the slot's sequence already in its row (`set_slot`); a decode step
    # counts the token it feeds only at positions from here on
    counted: jax.Array


def init_penalty_state(max_slots: int, vocab: int) -> PenaltyState:
    """Every slot neutral: no history, no bias, no penalty."""
    return PenaltyState(
        output_counts=jnp.zeros((max_slots, vocab), jnp.int32), in_prompt=jnp.zeros((max_slots, vocab), bool),
        logit_bias=jnp.zeros((max_slots, vocab), jnp.float32), repetition=jnp.ones((max_slots,), jnp.float32),
        frequency=jnp.zeros((max_slots,), jnp.float32), presence=jnp.zeros((max_slots,), jnp.float32),
        counted=jnp.zeros((max_slots,), jnp.int32))


@struct.dataclass
class SlotHistory:
    """One slot's row of a `PenaltyState`, built on the host (`slot_history`)."""

    output_counts: np.ndarray  # i32[V]
    in_prompt: np.ndarray  # bool[V]
    logit_bias: np.ndarray  # f32[V]
    factors: np.ndarray  # f32[3]: repetition, frequency, presence
    counted: np.ndarray  # i32[]: prompt + output tokens counted


def slot_history(vocab: int, prompt: Sequence[int], output: Sequence[int], repetition: float = 1.0,
                 frequency: float = 0.0, presence: float = 0.0,
                 logit_bias: Sequence[tuple[int, float]] = ()) -> SlotHistory:
    """The row of a request whose sequence so far is `prompt` + `output` (neutral with the defaults)."""
    bias = np.zeros(vocab, np.float32)
    for token, value in logit_bias:
        bias[token] = value
    in_prompt = np.zeros(vocab, bool)
    in_prompt[np.asarray(prompt, np.int64)] = True
    return SlotHistory(output_counts=np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(np.int32),
                       in_prompt=in_prompt, logit_bias=bias,
                       factors=np.asarray([repetition, frequency, presence], np.float32),
                       counted=np.asarray(len(prompt) + len(output), np.int32))


@functools.partial(jax.jit, donate_argnums=0)
def set_slot(state: PenaltyState, slot: jax.Array, row: SlotHistory) -> PenaltyState:
    """Write slot `slot` (i32[]) of the state: a request took it."""
    return PenaltyState(
        output_counts=state.output_counts.at[slot].set(row.output_counts),
        in_prompt=state.in_prompt.at[slot].set(row.in_prompt), logit_bias=state.logit_bias.at[slot].set(row.logit_bias),
        repetition=state.repetition.at[slot].set(row.factors[0]), frequency=state.frequency.at[slot].set(row.factors[1]),
        presence=state.presence.at[slot].set(row.factors[2]), counted=state.counted.at[slot].set(row.counted))


def count_fed(state: PenaltyState, slots: jax.Array, tokens: jax.Array, positions: jax.Array,
              active: jax.Array) -> PenaltyState:
    """Count the token each active decode row feeds, where it is an output token the host
    has not counted: slots, tokens, positions i32[R], active bool[R]."""
    new = active & (positions >= state.counted[slots])
    index = jnp.where(new, slots, state.counted.shape[0])  # out of range: dropped
    return state.replace(output_counts=state.output_counts.at[index, tokens].add(1, mode="drop"))


def penalize(logits: jax.Array, state: PenaltyState, slots: jax.Array) -> jax.Array:
    """Bias, then repetition, frequency and presence penalties: logits f32[R, V] of rows
    continuing `slots` i32[R] -> f32[R, V]. Neutral rows come back unchanged."""
    counts = state.output_counts[slots]  # i32[R, V]
    in_output = counts > 0
    x = logits.astype(jnp.float32) + state.logit_bias[slots]
    r = state.repetition[slots][:, None]
    x = jnp.where(state.in_prompt[slots] | in_output, jnp.where(x > 0, x / r, x * r), x)
    return x - state.frequency[slots][:, None] * counts - state.presence[slots][:, None] * in_output
