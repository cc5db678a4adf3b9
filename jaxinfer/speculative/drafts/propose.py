"""Model drafts inside the jitted step: k autoregressive forwards of a `DraftModel`.

Each draft token is sampled under its row's own temperature / top-k / top-p / min-p and
comes with the q it was drawn from (one-hot for greedy rows), so verification is exact.

- A separate draft has pages of its own (same page ids and block tables as the target's).
  It also runs the prefill rows, so its pages match the target's (prefix cache
  included), and writes d_k's K/V in one extra forward, needed when all k are accepted.
- A self-draft (the target's first layers) reads and writes the target's own pages for
  those layers; the target pass rewrites them right after.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv.paged_state import PagedKVState
from jaxinfer.model import ModelParams, TokenGroup, forward_groups
from jaxinfer.sampling import SamplingArrays, filter_logits, greedy_tokens
from jaxinfer.speculative.verify import Proposal
from jaxinfer.step import StepBatch, decode_rows, prefill_groups


def propose_with_model(
    params: ModelParams, config: ModelConfig, vocab: jax.Array | None, dkv: PagedKVState, batch: StepBatch,
    num_draft: jax.Array, k: int, keys: jax.Array, *, separate: bool, attention_impl: str,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Proposal, PagedKVState]:
    """k draft tokens per decode row, sampled from the draft under each row's sampling parameters.

    -> (Proposal(i32[R, k], q f32[R, k, Vd], q_vocab=vocab), the draft's cache). Row r writes
    only its first `num_draft[r] + 1` tokens (t0, d_1 .. d_num_draft); positions past that
    are never written.
    `keys`: key[R], the row's draft randomness; draft j uses fold_in(key, j).
    """
    slots = batch.decode_slots
    lengths, sampling = decode_rows(batch)  # i32[R], [R]
    current = batch.decode_tokens  # i32[R]
    tokens, probs = [], []
    for j in range(k + 1 if separate else k):
        group = TokenGroup(tokens=current[:, None], positions=(lengths + j)[:, None], slots=slots,
                           num_new=(batch.decode_active & (j <= num_draft)).astype(jnp.int32),
                           logits_index=jnp.zeros_like(slots), by_replica=True)
        extra = prefill_groups(batch) if separate and j == 0 else ()  # keep the draft's pages complete
        logits, dkv = forward_groups(params, config, dkv, (group,) + extra, attention_impl, mesh)
        if j == k:  # the extra forward only wrote d_k's K/V
            break
        step_keys = jax.vmap(lambda key: jax.random.fold_in(key, j))(keys)
        index, q = sample_draft(logits[0], sampling, step_keys)  # i32[R], f32[R, Vd]
        # A head over a subset: its index maps back to a token id; q stays over the subset
        # (`verify.full_vocab_q` widens it to the vocabulary only when some row samples).
        if vocab is not None:
            index = vocab[index]
        tokens.append(index)
        probs.append(q)
        current = index
    return Proposal(jnp.stack(tokens, axis=1), jnp.stack(probs, axis=1), vocab), dkv


def sample_draft(logits: jax.Array, s: SamplingArrays, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draw from the draft under the row's own temperature/top-k/top-p/min-p (any q is
    exact; one close to p is accepted more often): f32[B, Vd] -> (i32[B], q f32[B, Vd]).
    Greedy rows take the argmax with a one-hot q."""
    best = greedy_tokens(logits)
    one_hot = jax.nn.one_hot(best, logits.shape[-1], dtype=jnp.float32)

    def greedy(_):
        return best, one_hot

    def sampled(_):
        filtered = filter_logits(logits, s)
        drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        is_sampled = s.temperature > 0
        return (jnp.where(is_sampled, drawn, best),
                jnp.where(is_sampled[:, None], jax.nn.softmax(filtered, axis=-1), one_hot))

    return jax.lax.cond(jnp.all(s.temperature == 0), greedy, sampled, None)
