"""Speculative verification: accept or correct draft tokens so the output follows the target.

Given k draft tokens `d_1..d_k` drawn from the draft's distributions `q_1..q_k`, and the
target's distributions `p_1..p_{k+1}` at the same k+1 positions (one target forward over
the block), the rule of Leviathan et al. / Chen et al. is::

    for i = 1..k:   accept d_i with probability  a_i = min(1, p_i(d_i) / q_i(d_i))
    first reject:   emit c ~ normalize(max(p_i - q_i, 0))        and stop
    all accepted:   emit a bonus token b ~ p_{k+1}

Each emitted token is then distributed exactly as the target's next-token distribution
given everything before it. `p` and `q` must be the distributions actually sampled from:
after temperature / top-k / top-p / min-p (`sampling.filter_logits`), so speculation is
invisible to the user. Greedy targets are one-hot `p`; deterministic (n-gram) drafts are
one-hot `q`; both are ordinary cases of the same rule, and for one-hot q the rule is "accept
d while it equals the target's own draw", which `verify_step` uses to emit exactly the tokens
plain decoding would (see there).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.sampling import SamplingArrays, filter_logits, greedy_tokens, sample_tokens


class Proposal(NamedTuple):
    """What every draft source hands the verifier (see `jaxinfer.speculative.drafts`)."""

    tokens: jax.Array  # i32[B, k]: proposed tokens; row b's entries past its num_draft are padding
    # f32[B, k, V] (or [B, k, Vd] with q_vocab): the distribution each token was drawn from,
    # or None for deterministic drafts (n-gram): q is then one-hot at `tokens`
    q: jax.Array | None
    # i32[Vd]: the token id of each entry of q's last axis, when the draft's head covers a
    # subset of the vocabulary; None: q covers all V
    q_vocab: jax.Array | None = None


def full_vocab_q(proposal: Proposal, vocab_size: int) -> jax.Array:
    """The proposal's q (a draft model's) over the whole vocabulary: f32[B, k, V]. Built only
    where some row samples: greedy verification needs nothing but the tokens."""
    if proposal.q_vocab is None:
        return proposal.q
    b, k, _ = proposal.q.shape
    return jnp.zeros((b, k, vocab_size), proposal.q.dtype).at[:, :, proposal.q_vocab].set(proposal.q)


def acceptance_probs(p: jax.Array, q: jax.Array, draft: jax.Array) -> jax.Array:
    """a_i = min(1, p_i(d_i) / q_i(d_i)).

    p, q: f[..., k, V]; draft: i32[..., k] -> f[..., k]. A draft token with q = 0 cannot
    have been drawn; it is rejected (a = 0) rather than dividing by zero.
    """
    pd = jnp.take_along_axis(p, draft[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    return jnp.where(qd > 0, jnp.minimum(1.0, pd / jnp.where(qd > 0, qd, 1.0)), 0.0)


def residual_distribution(p: jax.Array, q: jax.Array) -> jax.Array:
    """normalize(max(p - q, 0)) over the last axis: f[..., V] -> f[..., V].

    Where p <= q everywhere (then p == q and rejection has probability 0) the residual is
    undefined; p is returned so the result is always a distribution.
    """
    r = jnp.maximum(p - q, 0.0)
    mass = r.sum(axis=-1, keepdims=True)
    return jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), p)


def verify_draft(
    key: jax.Array,  # one PRNG key per row: key[B]
    draft: jax.Array,  # i32[B, k]: draft tokens
    q: jax.Array,  # f32[B, k, V]: draft distributions the tokens were drawn from
    p: jax.Array,  # f32[B, k + 1, V]: target distributions at the k + 1 positions
) -> tuple[jax.Array, jax.Array]:
    """-> (num_accepted i32[B] in [0, k], tokens i32[B, k + 1]).

    Row b emits `tokens[b, : num_accepted[b] + 1]`: the accepted drafts, then the
    correction (at the first rejection) or the bonus token (when all k were accepted).
    Entries past that are padding.
    """
    return jax.vmap(_verify_row)(key, draft, q, p)


def _verify_row(key, draft, q, p):
    k = draft.shape[0]
    k_accept, k_fix = jax.random.split(key)
    accept = jax.random.uniform(k_accept, (k,)) < acceptance_probs(p[:k], q, draft)
    n = jnp.argmin(jnp.append(accept, False))  # leading accepted drafts
    # Position n emits from the residual when a draft was rejected there, else from p_{k+1}.
    fix_q = jnp.where(n < k, q[jnp.minimum(n, k - 1)], 0.0)
    fix = residual_distribution(p[n], fix_q)
    correction = jax.random.categorical(k_fix, jnp.log(fix))
    tokens = jnp.append(draft, 0).at[n].set(correction)
    return n.astype(jnp.int32), tokens.astype(jnp.int32)


# ---- in the engine's step -------------------------------------------------------------------


def _per_position(s: SamplingArrays, t: int) -> SamplingArrays:
    """Row parameters [B] -> [B * t]: the same parameters at each of t positions."""
    return jax.tree.map(lambda a: jnp.repeat(jnp.asarray(a), t), s)


def sampling_probs(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """The distribution each row really samples from: f32[B, T, V] -> f32[B, T, V].

    softmax(filter_logits) for sampled rows; one-hot at the argmax for greedy rows.
    """
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    rows = _per_position(s, t)
    probs = jax.nn.softmax(filter_logits(flat, rows), axis=-1)
    greedy = jax.nn.one_hot(greedy_tokens(flat), v, dtype=probs.dtype)
    return jnp.where((rows.temperature > 0)[:, None], probs, greedy).reshape(b, t, v)


def verify_step(
    target_logits: jax.Array,  # f32[B, k + 1, V]: target logits after t0, d_1 .. d_k
    proposal: Proposal,  # the drafts d_1 .. d_k and their q
    num_draft: jax.Array,  # i32[B]: drafts to consider per row (the rest are padding)
    s: SamplingArrays,  # [B]
    keys: jax.Array,  # key[B]: each row's verification randomness (independent of its drafts')
    positions: jax.Array,  # i32[B]: the cache position of each row's first emitted token
) -> tuple[jax.Array, jax.Array]:
    """`verify_draft` for a batch of slots with per-row draft counts -> (i32[B], i32[B, k + 1]).

    Padding drafts (index >= num_draft) get q = 0: they are rejected with certainty and
    the residual max(p - 0, 0) is p itself, so a row with no drafts samples plainly from
    p. When every row is greedy, only the argmax of each position is needed and the
    V-sized distributions are never built.

    Deterministic drafts (n-gram: `proposal.q is None`, q one-hot) are verified by matching:
    position j draws the target's own token with the key a plain step uses there
    (`sample_tokens` at `positions + j`), and drafts are accepted while they equal those
    draws. For a one-hot q that is the rule above (d accepted with probability p(d), the
    correction drawn from p without d), and the output is plain decoding's, token for token,
    whatever was drafted: a seeded request gives the same text with and without n-gram
    speculation, and after a preemption that moves its verify blocks.
    """
    draft = proposal.tokens
    b, k = draft.shape
    v = target_logits.shape[-1]
    usable = jnp.arange(k)[None, :] < num_draft[:, None]  # bool[B, k]

    def leading_matches(tokens):  # i32[B, k + 1] -> i32[B]: drafts equal to the tokens, from the first
        return jnp.argmin(jnp.append(usable & (draft == tokens[:, :k]), jnp.zeros((b, 1), bool), axis=1),
                          axis=1).astype(jnp.int32)

    if proposal.q is None:
        where = positions[:, None] + jnp.arange(k + 1, dtype=positions.dtype)  # i32[B, k + 1]
        tokens = sample_tokens(target_logits.reshape(b * (k + 1), v), _per_position(s, k + 1), where.reshape(-1))
        tokens = tokens.reshape(b, k + 1)
        return leading_matches(tokens), tokens

    def greedy(_):
        best = greedy_tokens(target_logits)  # i32[B, k + 1]
        return leading_matches(best), best

    def sampled(_):
        q = jnp.where(usable[..., None], full_vocab_q(proposal, v), 0.0)
        n, tokens = verify_draft(keys, draft, q, sampling_probs(target_logits, s))
        n_greedy, best = greedy(None)
        is_greedy = s.temperature == 0
        return jnp.where(is_greedy, n_greedy, n), jnp.where(is_greedy[:, None], best, tokens)

    return jax.lax.cond(jnp.all(s.temperature == 0), greedy, sampled, None)
