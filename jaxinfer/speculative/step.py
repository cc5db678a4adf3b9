"""The jitted speculative step: draft k tokens, verify them in one target pass.

Each decoding request feeds `[t0, d_1 .. d_k]` (its pending token and the drafts) through
the target as one row of an `[R, k + 1]` group, so the target scores all k + 1 positions
in a single forward; `verify_step` then keeps a per-row number of drafts. Shapes stay
fixed: a row verifies `num_draft[r] <= k` drafts and the rest is padding. As in the plain
step (`jaxinfer.step`), R is a row bucket: decode-only steps pack their requests into the
first rows (`StepBatch.decode_slots` names each row's slot), so one request on an 8-slot
engine verifies one block, not eight.

Rejected drafts need no undo on the device. Their K/V were written past the accepted
tokens, and the host advances the slot's length only over what was kept, so the next
step overwrites them and attention never reads them (lengths mask everything after).
The same holds for the draft model's own cache, which shares the target's block tables:
one page id holds the target's K/V in the target pool and the draft's in the draft pool.

The draft source is chosen statically by `draft_config` / `shared_layers` and hands the
verifier a `Proposal` (`jaxinfer.speculative.drafts` describes the interface):
- host drafts (n-gram prompt lookup): tokens arrive in `DraftBatch.tokens`, q is one-hot;
- a draft model (`drafts.propose.propose_with_model`): k autoregressive draft forwards
  inside this step, over its own pages (a separate draft) or the target's first layers'
  pages (self-speculation).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import ModelConfig
from jaxinfer.kv.paged_state import PagedKVState
from jaxinfer.layer_stack import slice_layers
from jaxinfer.model import ModelParams, TokenGroup, forward_groups
from jaxinfer.penalties import PenaltyState, count_fed, penalize, penalize_block
from jaxinfer.sampling import SamplingArrays, row_keys
from jaxinfer.speculative.drafts.propose import propose_with_model
from jaxinfer.speculative.verify import Proposal, verify_step
from jaxinfer.step import StepBatch, bucket_view, decode_rows, prefill_groups, rows_by_slot, sample_prefill
from jaxinfer.structured_output import mask_logits


@struct.dataclass
class DraftBatch:
    tokens: jax.Array  # i32[R, k]: host-proposed drafts (n-gram) per decode row; unused with a draft model
    num_draft: jax.Array  # i32[R]: drafts to verify per decode row (0 = plain decode)
    # i32[R, k, W]: host drafts in a step with penalties or grammars: the structured-output mask
    # after each draft (`GrammarMatcher.draft_masks`; every token allowed for other rows)
    allowed: jax.Array | None = None


@struct.dataclass
class SpeculativeOutput:
    tokens: jax.Array  # i32[max_slots, k + 1]: slot b emits tokens[b, : num_accepted[b] + 1]
    num_accepted: jax.Array  # i32[max_slots]: drafts kept per slot
    prefill_tokens: jax.Array | None  # i32[P]: next token after each prefill row's chunk
    # The target's raw logits, for `step.step_logprobs` when a request asks (as in `StepOutput`)
    logits: jax.Array  # f32[R, k + 1, V]: position j of decode row r scored row_tokens[r, j]
    row_tokens: jax.Array  # i32[R, k + 1]: `tokens` by decode row
    prefill_logits: jax.Array | None  # f32[P, V]
    # the penalty histories after this step's kept tokens, when the step was given them
    penalties: PenaltyState | None = None

    @classmethod
    def by_slot(cls, tokens: jax.Array, num_accepted: jax.Array, batch: StepBatch, logits: tuple[jax.Array, ...],
                new_lengths: jax.Array, scored: tuple[jax.Array, ...],
                penalties: PenaltyState | None = None) -> SpeculativeOutput:
        """The output of a step whose decode rows verified into `tokens` i32[R, k + 1] /
        `num_accepted` i32[R], with the target's raw `logits` per group (decode block,
        prefill) and the ones sampled from (`scored`: `penalized_logits`)."""
        return cls(tokens=rows_by_slot(tokens, batch), num_accepted=rows_by_slot(num_accepted, batch),
                   prefill_tokens=sample_prefill(scored, batch, new_lengths), logits=logits[0],
                   row_tokens=tokens, prefill_logits=logits[1] if len(logits) > 1 else None, penalties=penalties)


def penalized_logits(logits: tuple[jax.Array, ...], batch: StepBatch, block: TokenGroup,
                     penalties: PenaltyState | None, new_lengths: jax.Array,
                     draft_allowed: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """What verification and prefill sampling read: the raw logits per group (decode block
    f32[R, k + 1, V], prefill f32[P, V]), penalized when the step has penalties, and masked
    to what each position's grammar allows (structured output): `batch.allowed` at each
    block's first position, `draft_allowed` i32[R, k, W] after each host draft (a model's
    drafts are never made for constrained rows, `Engine._draft_batch`). Every position is
    then the distribution a plain step would sample there, so verification stays exact."""
    if penalties is None:
        return logits
    scored = penalize_block(logits[0], penalties, batch.decode_slots, block.tokens, block.positions,
                            batch.decode_active)
    if batch.allowed is not None:
        scored = scored.at[:, 0].set(mask_logits(scored[:, 0], batch.allowed))
    if draft_allowed is not None:
        scored = scored.at[:, 1:].set(mask_logits(scored[:, 1:], draft_allowed))
    scored = (scored,)
    if len(logits) > 1:
        slots = batch.prefill.slots
        prefill = penalize(logits[1], penalties, slots, new_lengths[slots])
        scored += (prefill if batch.prefill.allowed is None else mask_logits(prefill, batch.prefill.allowed),)
    return scored


def count_kept(penalties: PenaltyState | None, batch: StepBatch, block: TokenGroup,
               num_accepted: jax.Array) -> PenaltyState | None:
    """The histories after each decode row kept its pending token and `num_accepted` i32[R] drafts."""
    if penalties is None:
        return None
    keep = batch.decode_active[:, None] & (jnp.arange(block.tokens.shape[1]) <= num_accepted[:, None])  # bool[R, k + 1]
    return count_fed(penalties, batch.decode_slots, block.tokens, block.positions, keep)


JIT_OPTIONS = dict(static_argnames=("config", "draft_config", "shared_layers", "attention_impl", "mesh"),
                   donate_argnames=("kv", "draft_kv", "penalties"))


@functools.partial(jax.jit, **JIT_OPTIONS)
def speculative_step(
    params: ModelParams, config: ModelConfig, kv: PagedKVState, batch: StepBatch, drafts: DraftBatch,
    draft_params: ModelParams | None = None,  # None: host drafts (n-gram)
    draft_vocab: jax.Array | None = None,  # i32[Vd]: token id of each draft logit (None = full vocab)
    draft_kv: PagedKVState | None = None,  # the draft's own pages (a separate draft model only)
    draft_config: ModelConfig | None = None,
    shared_layers: int = 0,  # > 0: self-speculation over the target's first layers
    attention_impl: str = "reference",
    mesh: jax.sharding.Mesh | None = None,  # the mesh both models and caches are sharded on
    penalties: PenaltyState | None = None,  # some request has penalties (`jaxinfer.penalties`)
) -> tuple[PagedKVState, PagedKVState | None, SpeculativeOutput]:
    """Propose, run the target over every slot's block and the prefill rows, verify; donates
    both caches (and the penalties). Block tables and lengths as in `engine_step` (a separate
    draft model reads the target's tables: its pages sit at the same page ids of its own pool).

    The target's raw logits at every position j of a block come back with the tokens, so
    `step.step_logprobs` can give accepted drafts and the correction/bonus token each their
    own logprob under the target, as in `engine_step`. With penalties, verification reads
    the penalized logits (`penalized_logits`): the target distribution a plain step would
    sample from, so speculation stays exact."""
    kept = (kv.block_tables, kv.lengths)
    kv = bucket_view(kv, batch)
    lengths, sampling = decode_rows(batch)  # i32[R], [R]
    num_draft = jnp.where(batch.decode_active, drafts.num_draft, 0)  # i32[R]
    k = drafts.tokens.shape[1]
    verify_keys, draft_keys = speculation_keys(sampling, lengths)

    if draft_config is None:
        proposal = Proposal(drafts.tokens, None)
    elif shared_layers:
        # (stacked: the engine ends a run at shared_layers, so these slices copy nothing)
        dkv = dataclasses.replace(kv, layers=slice_layers(kv.layers, 0, shared_layers))
        proposal, dkv = propose_with_model(draft_params, draft_config, draft_vocab, dkv, batch, num_draft, k,
                                           draft_keys, separate=False, attention_impl=attention_impl, mesh=mesh)
        kv = dataclasses.replace(kv, layers=dkv.layers + slice_layers(kv.layers, shared_layers, config.n_layers))
    else:
        draft_owned = (draft_kv.block_tables, draft_kv.lengths)
        dkv = dataclasses.replace(draft_kv, block_tables=kv.block_tables, lengths=batch.lengths)
        proposal, dkv = propose_with_model(draft_params, draft_config, draft_vocab, dkv, batch, num_draft, k,
                                           draft_keys, separate=True, attention_impl=attention_impl, mesh=mesh)
        draft_kv = dataclasses.replace(dkv, block_tables=draft_owned[0], lengths=draft_owned[1])

    block = verify_block(batch, proposal, num_draft)
    logits, kv = forward_groups(params, config, kv, (block,) + prefill_groups(batch), attention_impl, mesh)
    scored = penalized_logits(logits, batch, block, penalties, kv.lengths, drafts.allowed)
    num_accepted, tokens = verify_step(scored[0], proposal, num_draft, sampling, verify_keys, lengths + 1)
    out = SpeculativeOutput.by_slot(tokens, num_accepted, batch, logits, kv.lengths, scored,
                                    count_kept(penalties, batch, block, num_accepted))
    return dataclasses.replace(kv, block_tables=kept[0], lengths=kept[1]), draft_kv, out


def speculation_keys(sampling: SamplingArrays, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each decode row's (verification, draft) keys from its (seed, position): two independent
    streams. (Deriving the draft's keys with fold_in(key, 1) would reuse split(key)[1], the
    key of the correction, and bias the output: the sampled end-to-end test catches exactly
    that.) sampling [R], lengths i32[R] -> (key[R], key[R])."""
    keys = jax.vmap(jax.random.split)(row_keys(sampling.seed, lengths + 1))  # key[R, 2]
    return keys[:, 0], keys[:, 1]


def verify_block(batch: StepBatch, proposal: Proposal, num_draft: jax.Array) -> TokenGroup:
    """Each decode row's `[t0, d_1 .. d_k]` as one group: i32[R, k + 1] at the row's slot."""
    k = proposal.tokens.shape[1]
    return TokenGroup(
        tokens=jnp.concatenate([batch.decode_tokens[:, None], proposal.tokens], axis=1),
        positions=batch.lengths[batch.decode_slots][:, None] + jnp.arange(k + 1, dtype=jnp.int32),
        slots=batch.decode_slots, num_new=jnp.where(batch.decode_active, 1 + num_draft, 0), by_replica=True,
    )

