"""Training an EAGLE head (`jaxinfer.speculative.eagle`) by self-distillation, with EAGLE-3's
"training-time test".

Data: the target answers instructions through the engine (`data.generate_sequences`): the
built-in ones (`prompts.expanded_prompts`) and optionally ones it writes itself
(`data.self_written_prompts`, more varied than templates), and
one teacher-forced dense pass stores, per position, the target's streams the head reads
(f16: after each of its `feature_layers`, or after the last layer before the final norm)
and its top-k next-token log-probs.

The head is trained the way it is used. At inference it drafts d_1 from true features,
then d_2, d_3, ... from features it predicted itself, attending to true-feature pairs for
the accepted context and to its own earlier predictions for the drafts. Training unrolls
`ttt_steps` such steps over whole sequences at once: step j's input at pair t is step
j-1's prediction at pair t-1, and its query attends to step 0's keys at pairs <= t - j plus
the chain of its own earlier steps' keys (step i's key at pair t - j + i). Each step's loss
is the cross-entropy of the head's subset distribution against the teacher's next-token
distribution (top-k, restricted and renormalised to the subset), so later draft positions
are trained on the inputs they will really see.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.config import ModelConfig
from jaxinfer.loading import Model
from jaxinfer.model.layers import apply_rope, linear, rms_norm, rope_inv_freq, swiglu_mlp
from jaxinfer.model.params import lm_head_weight
from jaxinfer.speculative.eagle.head import (EagleParams, check_feature_layers, default_feature_layers, head_inputs,
                                             init_eagle_params, target_features)
from jaxinfer.speculative.train.data import (Log, DistillData, check_vocab_subset, frequency_ranked_vocab,
                                             generate_sequences, held_out_split, pad_sequences, self_written_prompts,
                                             subset_coverage, subset_targets)
from jaxinfer.speculative.train.dense import dense_streams
from jaxinfer.speculative.train.loop import training_schedule
from jaxinfer.speculative.train.prompts import expanded_prompts


@dataclasses.dataclass(frozen=True)
class EagleTrainingConfig:
    """Every choice of `train_eagle` (the CLI's defaults are these)."""

    vocab_subset: int = 8192  # LM head rows: the most frequent training tokens (FR-Spec)
    num_prompts: int = 628  # first num_prompts of `expanded_prompts()`
    # more instructions the target writes itself (`self_written_prompts`), after those; 0 for a
    # target without a chat template (prompts passed to `train_eagle` are used as they are)
    self_prompts: int = 628
    new_tokens: int = 192
    temperatures: tuple[float, ...] = (0.0,)  # greedy answers ((0.0, 0.8) made the head before: checkpoints/README.md)
    top_k: int = 32  # teacher log-probs kept per position
    ttt_steps: int = 3  # training-time test: head steps unrolled on their own predictions
    # target layers the head fuses (EAGLE-3); "auto": `default_feature_layers` (low, middle, last);
    # (): the last layer's stream, unfused (the head shipped before; both measured in checkpoints/README.md)
    feature_layers: tuple[int, ...] | str = "auto"
    epochs: int = 8
    lr: float = 2e-3
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    batch_size: int = 8
    holdout_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_subset", "num_prompts", "new_tokens", "top_k", "ttt_steps", "epochs", "batch_size",
                     "holdout_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.self_prompts, int) or self.self_prompts < 0:
            raise ValueError(f"self_prompts={self.self_prompts!r} must be an integer >= 0")
        if not self.temperatures or any(not 0 <= t <= 2 for t in self.temperatures):
            raise ValueError(f"temperatures={self.temperatures!r} must be one or more values in [0, 2]")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if self.feature_layers != "auto" and not isinstance(self.feature_layers, tuple):
            raise ValueError(f"feature_layers={self.feature_layers!r} must be 'auto' or a tuple of layer indices")

    def resolved_feature_layers(self, n_layers: int) -> tuple[int, ...]:
        if self.feature_layers == "auto":
            return default_feature_layers(n_layers)
        return check_feature_layers(self.feature_layers, n_layers)


# ---- data: features and teacher distributions ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class FeatureData:
    """`DistillData` plus the target's features at every position."""

    distill: DistillData
    # f16[N, T, D]: position t's last-layer stream, or f16[N, T, n, D]: its n tapped streams
    features: np.ndarray


def teacher_features(target: Model, sequences: Sequence[np.ndarray], prompt_lengths: np.ndarray,
                     prompt_index: np.ndarray, top_k: int, batch_size: int = 4, log: Log | None = None,
                     feature_layers: tuple[int, ...] = ()) -> FeatureData:
    """One teacher-forced dense pass of the target over the sequences -> features (the
    streams after `feature_layers`, or the last layer's) + top-k."""
    tokens, lengths = pad_sequences(sequences)
    c = target.config
    last = c.n_layers - 1
    streams = tuple(sorted({*feature_layers, last}))
    keep = [streams.index(i) for i in feature_layers]

    @jax.jit
    def teach(params, batch):  # i32[B, T]; params an argument: a closed-over head would be folded as a constant
        head = lm_head_weight(params)  # [V, D]
        s = dense_streams(params, c, batch, streams)  # [B, T, len(streams), D]
        logits = jnp.einsum("btd,vd->btv", rms_norm(s[:, :, -1], params.final_norm, c.rms_eps), head,
                            preferred_element_type=jnp.float32)
        values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)
        f = s[:, :, keep] if feature_layers else s[:, :, -1]
        return f.astype(jnp.float16), ids.astype(jnp.int32), values

    feats, ids, logps = [], [], []
    for start in range(0, len(tokens), batch_size):
        batch = tokens[start : start + batch_size]
        pad = batch_size - len(batch)
        f, i, lp = teach(target.params, np.pad(batch, ((0, pad), (0, 0))))
        feats.append(np.asarray(f)[: len(batch)])
        ids.append(np.asarray(i)[: len(batch)])
        logps.append(np.asarray(lp)[: len(batch)])
        if log is not None and (start // batch_size % 25 == 24 or start + batch_size >= len(tokens)):
            log(f"teacher: {start + len(batch)}/{len(tokens)} sequences")
    distill = DistillData(tokens, lengths, np.concatenate(ids), np.concatenate(logps),
                          np.asarray(prompt_index, np.int32), np.asarray(prompt_lengths, np.int32))
    return FeatureData(distill, np.concatenate(feats))


def pair_targets(data: FeatureData, rows: np.ndarray, vocab_ids: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
    """Per pair t = (f_t, x_{t+1}): the teacher's distribution of x_{t+2} (its position t + 1),
    restricted to the subset; arrays [N, T] / [N, T, K] aligned to pairs."""
    targets = subset_targets(data.distill.rows(rows), vocab_ids, vocab_size)
    shift = lambda a: np.concatenate([a[:, 1:], np.zeros_like(a[:, :1])], axis=1)  # noqa: E731
    return {"tokens": targets["tokens"], "features": data.features[rows],
            "index": shift(targets["index"]), "prob": shift(targets["prob"]), "weight": shift(targets["weight"]),
            "answer": shift(targets["answer"]), "teacher_top1": shift(targets["teacher_top1"])}


# ---- the unrolled head ----------------------------------------------------------------------


def ttt_logits(params: EagleParams, embed: jax.Array, lm_head: jax.Array, config: ModelConfig, tokens: jax.Array,
               features: jax.Array, steps: int) -> list[jax.Array]:
    """The head unrolled `steps` times over whole sequences (module docstring) ->
    per step, logits f32[B, T, Vd] at every pair t (step j is meaningful for t >= j).
    `features`: the target's streams as `FeatureData` stores them ([B, T, D] or [B, T, n, D])."""
    c, layer = config, params.layer
    b, t = tokens.shape
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    next_tokens = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)  # x_{t+1} at pair t
    query, key = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    scale = 1.0 / math.sqrt(c.head_dim)
    keys, values, out = [], [], []
    feats = target_features(params, features, c.rms_eps).astype(jnp.float32)  # [B, T, D]
    for j in range(steps):
        x = head_inputs(params, embed, next_tokens, feats, c.rms_eps)  # [B, T, D]
        h = rms_norm(x, layer.attn_norm, c.rms_eps)
        q = apply_rope(linear(h, layer.wq).reshape(b, t, c.n_heads, c.head_dim), positions, inv_freq)
        q = q.reshape(b, t, c.n_kv_heads, c.q_per_kv, c.head_dim)  # [B, T, Hkv, G, Dh]
        keys.append(apply_rope(linear(h, layer.wk).reshape(b, t, c.n_kv_heads, c.head_dim), positions, inv_freq))
        values.append(linear(h, layer.wv).reshape(b, t, c.n_kv_heads, c.head_dim))
        # step 0's keys at pairs <= t - j (the accepted context), then the chain of steps 1..j
        scores = [jnp.where(key <= query - j, jnp.einsum("bqkgd,bskd->bkgqs", q, keys[0]) * scale, -jnp.inf)]
        chain_values = []
        for i in range(1, j + 1):
            lag = j - i  # step i's key for this query sits `lag` pairs earlier
            k_i = jnp.pad(keys[i], ((0, 0), (lag, 0), (0, 0), (0, 0)))[:, :t]
            chain_values.append(jnp.pad(values[i], ((0, 0), (lag, 0), (0, 0), (0, 0)))[:, :t])
            s = jnp.einsum("bqkgd,bqkd->bkgq", q, k_i)[..., None] * scale  # [B, Hkv, G, T, 1]
            scores.append(jnp.where(query >= lag, s, -jnp.inf))
        probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)  # [B, Hkv, G, T, T + j]
        attn = jnp.einsum("bkgqs,bskd->bqkgd", probs[..., :t], values[0])
        for i, v in enumerate(chain_values):
            attn = attn + jnp.einsum("bkgq,bqkd->bqkgd", probs[..., t + i], v)
        x = x + linear(attn.reshape(b, t, c.n_heads * c.head_dim), layer.wo)
        x = x + swiglu_mlp(rms_norm(x, layer.mlp_norm, c.rms_eps), layer.w_gate, layer.w_up, layer.w_down)
        out.append(jnp.einsum("btd,vd->btv", rms_norm(x, params.final_norm, c.rms_eps), lm_head,
                              preferred_element_type=jnp.float32))
        feats = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)  # pair t reads pair t-1's prediction
    return out


def _step_mask(t: int, j: int) -> jax.Array:
    return (jnp.arange(t) >= j).astype(jnp.float32)  # f32[T]: pairs where step j has a context


def ttt_loss(params: EagleParams, embed: jax.Array, lm_head: jax.Array, config: ModelConfig, batch: dict,
             steps: int) -> jax.Array:
    """Mean over steps of the weighted cross-entropy against the teacher's subset distribution."""
    total = 0.0
    for j, logits in enumerate(ttt_logits(params, embed, lm_head, config, batch["tokens"], batch["features"], steps)):
        logq = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logq, batch["index"], axis=-1)  # [B, T, K]
        weight = batch["weight"] * _step_mask(logits.shape[1], j)
        total += jnp.sum(-jnp.sum(batch["prob"] * picked, axis=-1) * weight) / jnp.maximum(weight.sum(), 1.0)
    return total / steps


def ttt_agreement(params: EagleParams, embed: jax.Array, lm_head: jax.Array, vocab_ids: jax.Array,
                  config: ModelConfig, batch: dict, steps: int) -> jax.Array:
    """f32[steps, 2]: (answer pairs where step j's argmax token is the teacher's, answer pairs)."""
    rows = []
    for j, logits in enumerate(ttt_logits(params, embed, lm_head, config, batch["tokens"], batch["features"], steps)):
        answer = batch["answer"] * _step_mask(logits.shape[1], j)
        hits = (vocab_ids[jnp.argmax(logits, axis=-1)] == batch["teacher_top1"]) * answer
        rows.append(jnp.stack([hits.sum(), answer.sum()]))
    return jnp.stack(rows)


TRAIN_KEYS = ("tokens", "features", "index", "prob", "weight")


def held_out_agreement(evaluate, params: EagleParams, targets: dict[str, np.ndarray], batch_size: int) -> list[float]:
    """Per head step j, the fraction of held-out answer pairs whose greedy draft is the
    target's greedy token (given a correct context): a proxy for acceptance at draft j + 1."""
    n = len(targets["tokens"])
    counts = 0.0
    for start in range(0, n, batch_size):
        rows = np.arange(start, start + batch_size) % n
        batch = {k: targets[k][rows] for k in ("tokens", "features", "answer", "teacher_top1")}
        batch["answer"] = batch["answer"] * (np.arange(start, start + batch_size) < n)[:, None]
        counts = counts + np.asarray(evaluate(params, batch))
    return [float(h / max(a, 1.0)) for h, a in counts]


def train_eagle(target: Model, cfg: EagleTrainingConfig = EagleTrainingConfig(),
                prompts: Sequence[str | Sequence[int]] | None = None, sequences_file: str | None = None,
                log: Log | None = None) -> tuple[EagleParams, np.ndarray, dict]:
    """Generate (or read from `sequences_file`, a cache of an earlier generation), teach and
    train -> (trained EagleParams, vocab_ids i32[Vd], figures for eagle.json)."""
    log = log or (lambda msg: None)
    feature_layers = cfg.resolved_feature_layers(target.config.n_layers)  # checked before an hour of generation
    check_vocab_subset(cfg.vocab_subset, target.config.vocab_size)
    t0 = time.perf_counter()
    sequences, prompt_lengths, prompt_index = _sequences(target, cfg, prompts, sequences_file, log)
    t_gen = time.perf_counter()
    data = teacher_features(target, sequences, prompt_lengths, prompt_index, cfg.top_k, log=log,
                            feature_layers=feature_layers)
    t_teach = time.perf_counter()
    log(f"data: {len(sequences)} sequences, {data.distill.num_tokens} tokens; generation {t_gen - t0:.0f} s, "
        f"teacher {t_teach - t_gen:.0f} s")

    train_rows, held_rows = held_out_split(data.distill.prompt_index, cfg.holdout_every)
    vocab_size = target.config.vocab_size
    vocab_ids = frequency_ranked_vocab([sequences[i] for i in train_rows], vocab_size, cfg.vocab_subset)
    train_targets = pair_targets(data, train_rows, vocab_ids, vocab_size)
    held_targets = pair_targets(data, held_rows, vocab_ids, vocab_size)
    coverage = subset_coverage(subset_targets(data.distill.rows(held_rows), vocab_ids, vocab_size), vocab_ids)

    c, tp = target.config, target.params
    embed = tp.embed
    lm_head = jnp.asarray(lm_head_weight(tp)[vocab_ids])
    vocab = jnp.asarray(vocab_ids)
    n = len(train_rows)
    batch_size, steps_per_epoch, optimizer = training_schedule(cfg, n)

    @jax.jit
    def step(params, opt_state, frozen, batch):  # frozen = (embed, lm_head): arguments, not folded constants
        loss, grads = jax.value_and_grad(ttt_loss)(params, *frozen, c, batch, cfg.ttt_steps)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    frozen = (embed, lm_head)
    agreement_counts = jax.jit(lambda params, frozen, batch: ttt_agreement(params, *frozen, c, batch, cfg.ttt_steps))
    evaluate = lambda params, batch: agreement_counts(params, (*frozen, vocab), batch)  # noqa: E731
    params = init_eagle_params(target, cfg.seed, feature_layers)
    opt_state = optimizer.init(params)
    init_agreement = held_out_agreement(evaluate, params, held_targets, batch_size)
    log(f"untrained head: held-out agreement per draft position {_fmt(init_agreement)}")
    rng = np.random.default_rng(cfg.seed)
    history = []
    for epoch in range(cfg.epochs):
        start, losses = time.perf_counter(), []
        order = rng.permutation(n)
        for i in range(steps_per_epoch):
            rows = order[i * batch_size : (i + 1) * batch_size]
            params, opt_state, loss = step(params, opt_state, frozen, {k: train_targets[k][rows] for k in TRAIN_KEYS})
            losses.append(float(loss))
            if i % 20 == 19:
                log(f"epoch {epoch + 1} step {i + 1}/{steps_per_epoch}: loss {np.mean(losses[-20:]):.4f}")
        agreement = held_out_agreement(evaluate, params, held_targets, batch_size)
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)), "seconds": time.perf_counter() - start,
                        "held_out_agreement": agreement,
                        "loss_curve": [float(np.mean(losses[i : i + 20])) for i in range(0, len(losses), 20)]})
        log(f"epoch {epoch + 1}: loss {history[-1]['loss']:.4f}, {history[-1]['seconds']:.0f} s, "
            f"held-out agreement per draft position {_fmt(agreement)}")
    seconds = {"generate": t_gen - t0, "teacher": t_teach - t_gen, "train": time.perf_counter() - t_teach,
               "total": time.perf_counter() - t0}
    return params, vocab_ids, {
        "config": dataclasses.asdict(cfg), "sequences_file": sequences_file, "sequences": len(sequences), "train_sequences": len(train_rows),
        "held_out_sequences": len(held_rows), "tokens": data.distill.num_tokens,
        "train_tokens": int(data.distill.lengths[train_rows].sum()),
        "held_out_tokens": int(data.distill.lengths[held_rows].sum()), "subset_coverage_held_out": coverage,
        "init_held_out_agreement": init_agreement, "epochs": history,
        "final_held_out_agreement": history[-1]["held_out_agreement"], "seconds": seconds,
    }


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _sequences(target: Model, cfg: EagleTrainingConfig, prompts: Sequence[str | Sequence[int]] | None, sequences_file: str | None,
               log: Log) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The target's answers: generated (32 slots through the engine), or read back from
    `sequences_file` when it exists (it is written after a generation)."""
    import os

    if sequences_file and os.path.exists(sequences_file):
        saved = np.load(sequences_file)
        sequences = np.split(saved["tokens"], np.cumsum(saved["lengths"])[:-1])
        log(f"read {len(sequences)} sequences from {sequences_file}")
        return sequences, saved["prompt_lengths"], saved["prompt_index"]
    if prompts is None:
        available = expanded_prompts()
        if cfg.num_prompts > len(available):
            raise ValueError(f"num_prompts={cfg.num_prompts} exceeds the {len(available)} built-in prompts")
        prompts = available[: cfg.num_prompts]
        if cfg.self_prompts:
            log(f"the target writes {cfg.self_prompts} more prompts")
            prompts += self_written_prompts(target, cfg.self_prompts, cfg.seed, progress=True)
    log(f"generating {len(prompts)} prompts x temperatures {cfg.temperatures}, {cfg.new_tokens} new tokens each")
    chat = all(isinstance(p, str) for p in prompts)  # token-id prompts (targets without a tokenizer) as they are
    sequences, prompt_lengths, prompt_index = generate_sequences(target, prompts, cfg.new_tokens, cfg.temperatures,
                                                                 cfg.seed, chat=chat, max_slots=32, progress=True)
    if sequences_file:
        np.savez(sequences_file, tokens=np.concatenate(sequences), lengths=np.asarray([len(s) for s in sequences]),
                 prompt_lengths=prompt_lengths, prompt_index=prompt_index,
                 **({"prompts": np.asarray(prompts)} if chat else {}))  # the instructions, for the record
    return sequences, prompt_lengths, prompt_index
