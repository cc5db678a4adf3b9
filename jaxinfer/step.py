"""The plain device step: a group of decode rows plus an optional prefill group.

It sits below both `jaxinfer.speculative` (whose verifying step reuses its batch and
prefill helpers) and `jaxinfer.engine` (which drives it).

Two kinds of program exist, whatever the traffic: decode-only, and decode + prefill (one
`[max_prefill_rows, prefill_chunk]` group), each compiled once per *context bucket*: the
block tables are cut to the smallest of a few widths (`EngineConfig.min_context_bucket`,
x4 each) that holds every running sequence, so attention over short contexts does not gather `max_model_len` keys.
Every other array in a `StepBatch` has a shape fixed at engine construction. The block tables
themselves stay on the device (`PagedKVState.block_tables`), kept current by the engine with
the entries that changed (`jaxinfer.kv.table_updates`); a step reads their first `width`
columns.

Decode-only programs are also compiled per *row bucket*: the decode group has R rows (a few
sizes up to `max_slots`, `decode_row_buckets`), each continuing the slot `decode_slots[r]`, so
a lone request on an 8-slot engine does not pay for 8 rows' matmuls. Tokens come back by
slot whatever R is, so what reads them (the engine, `feed_decode_tokens`) has one shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import ModelConfig
from jaxinfer.kv.paged_state import PagedKVState
from jaxinfer.model import ModelParams, TokenGroup, forward_groups
from jaxinfer.penalties import PenaltyState, count_fed, penalize
from jaxinfer.sampling import SamplingArrays, TokenLogprobs, sample_tokens, token_logprobs
from jaxinfer.structured_output import mask_logits


@struct.dataclass
class PrefillBatch:
    tokens: jax.Array  # i32[P, C]: a chunk of pending tokens per row, right-padded
    slots: jax.Array  # i32[P]: the slot each row continues
    num_new: jax.Array  # i32[P]: valid tokens per row (0 = unused row)
    shared: jax.Array  # i32[P]: tokens of each row's sequence in shared prefix-cache pages (`TokenGroup.shared`)
    allowed: jax.Array | None = None  # i32[P, W]: as `StepBatch.allowed`, for each row's next token


@struct.dataclass
class StepBatch:
    width: int = struct.field(pytree_node=False)  # the context bucket: block-table columns the step reads
    lengths: jax.Array  # i32[max_slots]: tokens cached per slot before this step
    # R decode rows (R = max_slots with row r = slot r in steps with prefill rows and on a
    # mesh with several data replicas; active rows first otherwise, `Engine._batch`)
    decode_tokens: jax.Array  # i32[R]: the one pending token of each decode row
    decode_slots: jax.Array  # i32[R]: the slot each decode row continues
    decode_active: jax.Array  # bool[R]: False = idle row (writes and returns nothing)
    sampling: SamplingArrays  # [max_slots]: per-slot sampling parameters
    prefill: PrefillBatch | None = None
    # i32[R, W]: the tokens each decode row may sample, a packed bitmask (structured output,
    # `jaxinfer.structured_output`); present in the programs that take penalties, else None
    allowed: jax.Array | None = None


@struct.dataclass
class StepOutput:
    decode_tokens: jax.Array  # i32[max_slots]: next token per slot (meaningful where a row decoded it)
    prefill_tokens: jax.Array | None  # i32[P]: next token after each row's chunk
    # The raw logits the tokens were sampled from, for `step_logprobs`: logprobs and their
    # top-k cost a log_softmax and a top-k over the vocabulary per row, paid only when a
    # request asks for them (the engine leaves these on the device otherwise).
    decode_logits: jax.Array  # f32[R, V]: per decode row
    decode_row_tokens: jax.Array  # i32[R]: the token each decode row sampled (`decode_tokens` by row)
    prefill_logits: jax.Array | None  # f32[P, V]
    # the penalty histories after this step's tokens (`jaxinfer.penalties`), when the step was
    # given them: pass them to the next step (they are donated there)
    penalties: PenaltyState | None = None


JIT_OPTIONS = dict(static_argnames=("config", "attention_impl", "mesh"), donate_argnames=("kv", "penalties"))


@functools.partial(jax.jit, **JIT_OPTIONS)
def engine_step(params: ModelParams, config: ModelConfig, kv: PagedKVState, batch: StepBatch,
                attention_impl: str = "reference", mesh: jax.sharding.Mesh | None = None,
                penalties: PenaltyState | None = None,
                ) -> tuple[PagedKVState, StepOutput]:
    """Run every scheduled token through the model and sample; donates `kv` (and `penalties`).

    Lengths come from the host in `batch`, the block tables are the state's own (their
    first `batch.width` columns, `bucket_view`); the returned state keeps the full tables
    and the lengths it came in with, so its shapes never depend on the bucket.

    The sampled token of a row is keyed by (seed, its future cache position), so a request
    draws the same tokens whether it decodes, prefills in chunks or is recomputed after
    preemption. The logits come back with the tokens, so that `step_logprobs` can give each
    token its logprob and top alternatives when a request asks for them. On a mesh
    (`jaxinfer.sharding.shard_engine`), `mesh` is the one params and cache are sharded on.
    With `penalties` (some request of the batch asked for them), each decode row's token
    is counted into its slot's history and the rows' logits are penalized before sampling
    (`jaxinfer.penalties`), then masked to the tokens `batch.allowed` allows (structured
    output); the updated histories come back in `StepOutput.penalties`.
    """
    kept = (kv.block_tables, kv.lengths)  # returned untouched: the engine updates both
    kv = bucket_view(kv, batch)
    slots = batch.decode_slots
    decode = TokenGroup(
        tokens=batch.decode_tokens[:, None], positions=batch.lengths[slots][:, None], slots=slots,
        num_new=batch.decode_active.astype(jnp.int32), logits_index=jnp.zeros_like(slots), by_replica=True,
    )
    logits, kv = forward_groups(params, config, kv, (decode,) + prefill_groups(batch), attention_impl, mesh)
    if penalties is not None:
        penalties = count_fed(penalties, slots, batch.decode_tokens[:, None], decode.positions,
                              batch.decode_active[:, None])
    out = sample_rows(logits, batch, kv.lengths, penalties)
    kv = dataclasses.replace(kv, block_tables=kept[0], lengths=kept[1])
    return kv, out


def bucket_view(kv: PagedKVState, batch: StepBatch) -> PagedKVState:
    """`kv` as a step sees it: block tables cut to the batch's bucket (a static slice,
    i32[max_slots, width]) and the batch's lengths (i32[max_slots])."""
    return dataclasses.replace(kv, block_tables=kv.block_tables[:, : batch.width], lengths=batch.lengths)


def sample_rows(logits: tuple[jax.Array, ...], batch: StepBatch, new_lengths: jax.Array,
                penalties: PenaltyState | None = None) -> StepOutput:
    """Sample the next token of every decode row (`logits[0]`: f32[R, V]) and prefill row
    (`logits[1]`: f32[P, V]) in one pass over the R + P rows: one filtering program instead
    of two (most of the step's compile time beside the layers). A row is keyed like a
    decode token of its slot. The output keeps the raw logits (penalties change only what
    is sampled)."""
    r = logits[0].shape[0]
    slots, rows = batch.decode_slots, logits[0]  # of each row sampled: i32[R (+ P)], f32[R (+ P), V]
    if batch.prefill is not None:
        slots, rows = jnp.concatenate([slots, batch.prefill.slots]), jnp.concatenate(logits)
    sampling = jax.tree.map(lambda a: a[slots], batch.sampling)
    positions = new_lengths[slots]  # i32[R + P]: where each row's token goes
    if penalties is not None:
        rows = penalize(rows, penalties, slots, positions)
    if batch.allowed is not None:
        rows = mask_logits(rows, allowed_rows(batch))
    tokens = sample_tokens(rows, sampling, positions)  # i32[R + P]
    by_slot = rows_by_slot(tokens[:r], batch)
    if batch.prefill is None:
        return StepOutput(decode_tokens=by_slot, prefill_tokens=None, decode_logits=logits[0],
                          decode_row_tokens=tokens, prefill_logits=None, penalties=penalties)
    return StepOutput(decode_tokens=by_slot, prefill_tokens=tokens[r:], decode_logits=logits[0],
                      decode_row_tokens=tokens[:r], prefill_logits=logits[1], penalties=penalties)


def allowed_rows(batch: StepBatch) -> jax.Array:
    """The bitmasks of the decode rows, then the prefill rows' (i32[R (+ P), W])."""
    if batch.prefill is None:
        return batch.allowed
    return jnp.concatenate([batch.allowed, batch.prefill.allowed])


def decode_rows(batch: StepBatch) -> tuple[jax.Array, SamplingArrays]:
    """Each decode row's cache length before the step and sampling parameters, gathered from
    the batch's per-slot arrays: (i32[R], SamplingArrays[R])."""
    slots = batch.decode_slots
    return batch.lengths[slots], jax.tree.map(lambda a: a[slots], batch.sampling)


def rows_by_slot(values: jax.Array, batch: StepBatch) -> jax.Array:
    """Per decode row values [R, ...] -> per slot [max_slots, ...], zeros where no row
    decoded. Idle rows (which may name the slot of an active one) are dropped."""
    b = batch.lengths.shape[0]
    index = jnp.where(batch.decode_active, batch.decode_slots, b)
    return jnp.zeros((b, *values.shape[1:]), values.dtype).at[index].set(values, mode="drop")


def prefill_groups(batch: StepBatch) -> tuple[TokenGroup, ...]:
    """The batch's prefill rows as a token group (logits at each row's last token), or ().
    The engine lays them out by data replica (`Scheduler.schedule`)."""
    if batch.prefill is None:
        return ()
    p = batch.prefill
    chunk = p.tokens.shape[1]
    return (TokenGroup(
        tokens=p.tokens, positions=batch.lengths[p.slots][:, None] + jnp.arange(chunk, dtype=jnp.int32),
        slots=p.slots, num_new=p.num_new, logits_index=jnp.maximum(p.num_new - 1, 0), by_replica=True, shared=p.shared,
    ),)


def sample_prefill(logits: tuple[jax.Array, ...], batch: StepBatch, new_lengths: jax.Array) -> jax.Array | None:
    """The token after each prefill row's chunk (`logits[1]`), keyed like a decode token."""
    if batch.prefill is None:
        return None
    rows = jax.tree.map(lambda a: a[batch.prefill.slots], batch.sampling)
    return sample_tokens(logits[1], rows, new_lengths[batch.prefill.slots])


@jax.jit
def feed_decode_tokens(host_tokens: jax.Array, feed: jax.Array, previous_decode: jax.Array,
                       previous_prefill: jax.Array) -> jax.Array:
    """Asynchronous scheduling: each decode row's input token, taken on the device from the
    previous step's output where the host does not have it yet.

    host_tokens i32[R] (the tokens the host knows), feed i32[R] (-1: the host's token; b < B:
    the previous step's decode token of slot b; B + p: its token after prefill row p),
    previous_decode i32[B] (by slot), previous_prefill i32[P] -> i32[R].
    """
    previous = jnp.concatenate([previous_decode, previous_prefill])  # i32[B + P]
    return jnp.where(feed >= 0, previous[jnp.maximum(feed, 0)], host_tokens)


def step_logits(out) -> tuple:
    """`step_logprobs`'s arguments out of a step's outputs: a plain step's `StepOutput`, or a
    speculative step's (whose logits score each row's verified block)."""
    if isinstance(out, StepOutput):
        return out.decode_logits, out.decode_row_tokens, out.prefill_logits, out.prefill_tokens
    return out.logits, out.row_tokens, out.prefill_logits, out.prefill_tokens


@jax.jit
def step_logprobs(logits: jax.Array, tokens: jax.Array, prefill_logits: jax.Array | None = None,
                  prefill_tokens: jax.Array | None = None) -> tuple[TokenLogprobs, TokenLogprobs | None]:
    """The logprob program, run apart from the step and only when a request asks: each
    emitted token's logprob and top `MAX_LOGPROBS` alternatives (`sampling.token_logprobs`).

    logits f32[B, V] with tokens i32[B] (plain step), or f32[B, k + 1, V] with i32[B, k + 1]
    (a verified block); prefill_logits f32[P, V] with prefill_tokens i32[P], or None.
    -> (TokenLogprobs[B] or [B, k + 1], TokenLogprobs[P] or None).
    """
    prefill = None if prefill_tokens is None else token_logprobs(prefill_logits, prefill_tokens)
    return token_logprobs(logits, tokens), prefill
