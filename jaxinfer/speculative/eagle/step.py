"""The jitted EAGLE step: draft with the head, verify with the target, keep the features.

The head's pair at position i needs the target's feature f_i and the token x_{i+1}, so a
pair becomes computable one step after its feature: the target computes f_L .. f_{L+k}
for a slot's verify block [x_L, d_1 .. d_k], verification keeps n drafts, and only then
are x_{L+1} .. x_{L+n+1} known. Each step therefore

1. runs the head over the pairs its slot carried from the previous step (`EagleState.
   features` f_{L-c} .. f_{L-1}, tokens x_{L-c+1} .. x_L from the host: c = n + 1 of that
   step) in one block, which writes their K/V into the head's pages and predicts the first
   draft, then k - 1 more single-token head forwards on its own predicted features;
2. runs the target over every slot's [x_L, d_1 .. d_k] and the prefill rows, keeping its
   hidden states (fused into one feature per position for an EAGLE-3 head);
3. verifies (`verify_step`, exact for every sampling setting);
4. runs the head over the prefill rows' pairs (all but the chunk's last token's, whose
   next token is not known yet) and stores the features to carry: the decode block's
   f_L .. f_{L+k} per slot, or a prefill row's last feature.

The head's pages share the target's block tables (one page id, two pools), and like the
target's they need no undo: pairs written at draft positions are rewritten with the true
features by the next step's block, and lengths mask everything past them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import ModelConfig
from jaxinfer.kv.paged_state import PagedKVState
from jaxinfer.model import ModelParams, TokenGroup, forward_hidden
from jaxinfer.speculative.drafts.propose import sample_draft
from jaxinfer.speculative.eagle.head import EagleParams, head_inputs, target_features
from jaxinfer.penalties import PenaltyState
from jaxinfer.speculative.step import SpeculativeOutput, count_kept, penalized_logits, speculation_keys, verify_block
from jaxinfer.speculative.verify import Proposal, verify_step
from jaxinfer.step import StepBatch, bucket_view, decode_rows, prefill_groups


@struct.dataclass
class EagleState:
    """The head's device state, donated and returned by every step like the target's cache."""

    kv: PagedKVState  # the head's one layer of pages (the target's page ids and block tables)
    features: jax.Array  # f[max_slots, k + 1, D]: target features each slot carries to its next step


@struct.dataclass
class EagleBatch:
    """What the host tells the step about drafting (`Engine._draft_batch`), per decode row."""

    num_draft: jax.Array  # i32[R]: drafts to verify per decode row (0 = plain decode)
    # i32[R, k + 1]: the tokens after the carried features, left-aligned: the row's request's
    # last `carried` tokens (its pending token last)
    head_tokens: jax.Array
    carried: jax.Array  # i32[R]: carried pairs per row (0: none, the row cannot draft)
    prefill_carried: jax.Array | None = None  # bool[P]: the prefill row continues a carried feature

    @property
    def width(self) -> int:
        return self.head_tokens.shape[1] - 1


def _head_forward(head: EagleParams, embed: jax.Array, lm_head: jax.Array, config: ModelConfig, hkv: PagedKVState,
                  group: TokenGroup, features: jax.Array, attention_impl: str):
    """One head forward over a group of pairs -> (logits f32[B, Vd] at `logits_index`,
    predicted features [B, T, D], the head's cache)."""
    x = head_inputs(head, embed, group.tokens, features, config.rms_eps)  # [B, T, D]
    model = ModelParams(embed=embed, layers=(head.layer,), final_norm=head.final_norm, lm_head=lm_head)
    (logits,), (hidden,), hkv = forward_hidden(model, config, hkv, (group,), attention_impl,
                                               inputs=x.reshape(-1, x.shape[-1]))
    return logits, hidden, hkv


def propose_eagle(head: EagleParams, embed: jax.Array, lm_head: jax.Array, vocab: jax.Array, config: ModelConfig,
                  state: EagleState, tables: jax.Array, batch: StepBatch, drafts: EagleBatch, num_draft: jax.Array,
                  keys: jax.Array, attention_impl: str) -> tuple[Proposal, PagedKVState]:
    """k drafts per decode row: the carried pairs in one block, then k - 1 pairs of the
    head's own predictions -> (Proposal(i32[R, k], q f32[R, k, Vd] over `vocab`), the head's
    cache). `tables` i32[max_slots, width]: the target's block tables (the head's pages share
    their ids)."""
    k, slots = drafts.width, batch.decode_slots
    lengths, sampling = decode_rows(batch)  # i32[R], [R]
    carried = jnp.where(batch.decode_active, drafts.carried, 0)  # i32[R]
    start = lengths - carried  # head position of the first carried pair
    hkv = dataclasses.replace(state.kv, block_tables=tables, lengths=batch.lengths.at[
        jnp.where(batch.decode_active, slots, batch.lengths.shape[0])].set(start, mode="drop"))
    group = TokenGroup(tokens=drafts.head_tokens, positions=start[:, None] + jnp.arange(k + 1, dtype=jnp.int32),
                       slots=slots, num_new=carried, logits_index=jnp.maximum(carried - 1, 0), by_replica=True)
    logits, hidden, hkv = _head_forward(head, embed, lm_head, config, hkv, group, state.features[slots],
                                        attention_impl)
    feature = jnp.take_along_axis(hidden, jnp.maximum(carried - 1, 0)[:, None, None], axis=1)  # [R, 1, D]
    tokens, probs = [], []
    for j in range(k):
        step_keys = jax.vmap(lambda key: jax.random.fold_in(key, j))(keys)
        index, q = sample_draft(logits, sampling, step_keys)  # i32[R], f32[R, Vd]
        tokens.append(vocab[index])
        probs.append(q)
        if j == k - 1:
            break
        # pair (f'_{L+j}, d_{j+1}) at position L + j drafts d_{j+2}; only rows that verify it write
        group = TokenGroup(tokens=tokens[-1][:, None], positions=(lengths + j)[:, None], slots=slots,
                           num_new=(batch.decode_active & (j + 1 < num_draft)).astype(jnp.int32),
                           logits_index=jnp.zeros_like(slots), by_replica=True)
        logits, feature, hkv = _head_forward(head, embed, lm_head, config, hkv, group, feature, attention_impl)
    return Proposal(jnp.stack(tokens, axis=1), jnp.stack(probs, axis=1), q_vocab=vocab), hkv


def _prefill_pairs(head: EagleParams, embed: jax.Array, lm_head: jax.Array, config: ModelConfig, hkv: PagedKVState,
                   batch: StepBatch, drafts: EagleBatch, features: jax.Array, carried_features: jax.Array,
                   attention_impl: str) -> PagedKVState:
    """The head over a prefill chunk's pairs: (carried f_{s-1}, x_s) when the row carries one,
    then (f_i, x_{i+1}) within the chunk. features: [P, C, D], the target's over the chunk."""
    p = batch.prefill
    chunk = p.tokens.shape[1]
    carry = drafts.prefill_carried & (p.num_new > 0)  # bool[P]
    shifted_features = jnp.concatenate([carried_features[p.slots, 0][:, None], features[:, :-1]], axis=1)
    pair_features = jnp.where(carry[:, None, None], shifted_features, features)  # [P, C, D]
    pair_tokens = jnp.where(carry[:, None], p.tokens, jnp.concatenate([p.tokens[:, 1:], p.tokens[:, :1]], axis=1))
    num_pairs = jnp.where(p.num_new > 0, p.num_new - 1 + carry, 0)
    start = batch.lengths[p.slots] - carry
    hkv = dataclasses.replace(hkv, lengths=hkv.lengths.at[p.slots].set(start))
    group = TokenGroup(tokens=pair_tokens, positions=start[:, None] + jnp.arange(chunk, dtype=jnp.int32),
                       slots=p.slots, num_new=num_pairs, logits_index=jnp.zeros_like(p.slots), by_replica=True)
    _, _, hkv = _head_forward(head, embed, lm_head, config, hkv, group, pair_features, attention_impl)
    return hkv


def _carry(features: jax.Array, batch: StepBatch, block_hidden: jax.Array, prefill_hidden: jax.Array | None
           ) -> jax.Array:
    """The features each slot carries: its verify block's (decoding slots: `block_hidden`
    [R, k + 1, D] by row) or its prefill chunk's last (prefilled slots); other slots keep
    theirs. -> f[max_slots, k + 1, D]"""
    b = features.shape[0]
    new = features.at[jnp.where(batch.decode_active, batch.decode_slots, b)].set(
        block_hidden.astype(features.dtype), mode="drop")
    if prefill_hidden is None:
        return new
    p = batch.prefill
    last = jnp.take_along_axis(prefill_hidden, jnp.maximum(p.num_new - 1, 0)[:, None, None], axis=1)[:, 0]  # [P, D]
    # slot b <- its prefill row; idle rows (num_new 0) all point at some slot and must not
    # win a scatter, so match rows to slots with a mask
    match = (p.slots[None, :] == jnp.arange(features.shape[0])[:, None]) & (p.num_new > 0)[None, :]  # bool[B, P]
    row = jnp.argmax(match, axis=1)
    return new.at[:, 0].set(jnp.where(match.any(axis=1)[:, None], last[row].astype(features.dtype), new[:, 0]))


JIT_OPTIONS = dict(static_argnames=("config", "head_config", "attention_impl"), donate_argnames=("kv", "state", "penalties"))


@functools.partial(jax.jit, **JIT_OPTIONS)
def eagle_step(
    params: ModelParams, config: ModelConfig, kv: PagedKVState, batch: StepBatch, drafts: EagleBatch,
    head: EagleParams,
    head_lm: jax.Array,  # [Vd, D]: the target's head rows `vocab`
    vocab: jax.Array,  # i32[Vd]
    state: EagleState,
    head_config: ModelConfig,
    attention_impl: str = "reference",
    penalties: PenaltyState | None = None,
) -> tuple[PagedKVState, EagleState, SpeculativeOutput]:
    """Draft with the head, verify with the target, run the head over the prefill rows and
    carry the features; donates both caches (and the penalties). Outputs and penalties as
    `speculative_step`'s."""
    kept = (kv.block_tables, kv.lengths)
    kv = bucket_view(kv, batch)
    lengths, sampling = decode_rows(batch)  # i32[R], [R]
    num_draft = jnp.where(batch.decode_active & (drafts.carried > 0), drafts.num_draft, 0)  # i32[R]
    verify_keys, draft_keys = speculation_keys(sampling, lengths)

    proposal, hkv = propose_eagle(head, params.embed, head_lm, vocab, head_config, state, kv.block_tables, batch, drafts,
                                  num_draft, draft_keys, attention_impl)
    block = verify_block(batch, proposal, num_draft)
    logits, taps, kv = forward_hidden(params, config, kv, (block,) + prefill_groups(batch), attention_impl,
                                      taps=head.feature_layers)
    hidden = [target_features(head, t, head_config.rms_eps) for t in taps]  # [B, T, D] per group
    scored = penalized_logits(logits, batch, block, penalties, kv.lengths)
    num_accepted, tokens = verify_step(scored[0], proposal, num_draft, sampling, verify_keys, lengths + 1)
    out = SpeculativeOutput.by_slot(tokens, num_accepted, batch, logits, kv.lengths, scored,
                                    count_kept(penalties, batch, block, num_accepted))
    prefill_hidden = None
    if batch.prefill is not None:
        prefill_hidden = hidden[1]
        hkv = _prefill_pairs(head, params.embed, head_lm, head_config, hkv, batch, drafts, prefill_hidden,
                             state.features, attention_impl)
    state = EagleState(kv=dataclasses.replace(hkv, block_tables=state.kv.block_tables, lengths=state.kv.lengths),
                       features=_carry(state.features, batch, hidden[0], prefill_hidden))
    return dataclasses.replace(kv, block_tables=kept[0], lengths=kept[1]), state, out
