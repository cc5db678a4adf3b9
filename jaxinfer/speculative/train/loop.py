"""The training loop: AdamW on the draft's distillation loss, and the whole procedure.

`train` minimises the cross-entropy of the draft's subset distribution against the
teacher's top-k restricted and renormalised to the subset (`data.subset_targets`), with a
warmup + cosine schedule and gradient clipping. Held-out sequences (whole prompts) give the
greedy top-1 agreement: the fraction of positions where the draft's argmax token is the
target's, a proxy for the greedy acceptance rate of each drafted token. `train_draft` runs
data generation, teaching and training end to end.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.config import ModelConfig
from jaxinfer.loading import Model
from jaxinfer.model.params import ModelParams
from jaxinfer.speculative.checkpoint import trainable, with_trainable
from jaxinfer.speculative.drafts.model import DraftModel, init_draft
from jaxinfer.speculative.train.data import (Log, build_distill_data, check_vocab_subset, frequency_ranked_vocab,
                                             generate_sequences, held_out_split, subset_coverage, subset_targets)
from jaxinfer.speculative.train.dense import dense_logits
from jaxinfer.speculative.train.prompts import DEFAULT_PROMPTS


@dataclasses.dataclass(frozen=True)
class DraftTrainingConfig:
    """Every choice of `train_draft` (the CLI's defaults are these)."""

    n_layers: int = 2  # draft layers, copied from the target's first n_layers
    vocab_subset: int = 8192  # LM head rows: the most frequent training tokens
    num_prompts: int = 100  # first num_prompts of the prompt list (each sampled at every temperature)
    new_tokens: int = 192  # tokens the target generates per prompt (at most)
    temperatures: tuple[float, ...] = (0.0, 0.8, 0.8)  # greedy once, sampled twice (distinct seeds)
    top_k: int = 32  # teacher log-probs kept per position
    epochs: int = 8
    lr: float = 2e-3  # peak AdamW learning rate (linear warmup, cosine decay to 10%)
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    batch_size: int = 8  # sequences per step
    holdout_every: int = 10  # every holdout_every-th prompt (all its samples) is held out
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "vocab_subset", "num_prompts", "new_tokens", "top_k", "epochs", "batch_size",
                     "holdout_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures={self.temperatures!r} must be a non-empty tuple of numbers >= 0")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")

def distill_loss(weights: dict, frozen: ModelParams, config: ModelConfig, batch: dict) -> jax.Array:
    """Mean over weighted positions of -sum_k p_teacher[k] * log q_draft[index[k]]."""
    params = dataclasses.replace(frozen, layers=tuple(weights["layers"]), final_norm=weights["final_norm"])
    logq = jax.nn.log_softmax(dense_logits(params, config, batch["tokens"]), axis=-1)  # f32[B, T, Vd]
    picked = jnp.take_along_axis(logq, batch["index"], axis=-1)  # f32[B, T, K]
    per_position = -jnp.sum(batch["prob"] * picked, axis=-1)  # f32[B, T]
    return jnp.sum(per_position * batch["weight"]) / jnp.maximum(jnp.sum(batch["weight"]), 1.0)


@functools.partial(jax.jit, static_argnames=("config",))
def _agreement_counts(params: ModelParams, config: ModelConfig, vocab_ids: jax.Array, batch: dict):
    """(answer positions where the draft's argmax token == the teacher's, answer positions)."""
    draft_top1 = vocab_ids[jnp.argmax(dense_logits(params, config, batch["tokens"]), axis=-1)]  # i32[B, T]
    hits = (draft_top1 == batch["teacher_top1"]) * batch["answer"]
    return jnp.sum(hits), jnp.sum(batch["answer"])


LOSS_KEYS = ("tokens", "index", "prob", "weight")


def _batches(targets: dict[str, np.ndarray], batch_size: int, order: np.ndarray):
    """Fixed-size training batches over `order` (a short last batch is dropped; order is reshuffled)."""
    for start in range(0, len(order) - batch_size + 1, batch_size):
        rows = order[start : start + batch_size]
        yield {k: targets[k][rows] for k in LOSS_KEYS}


def top1_agreement(draft: DraftModel, targets: dict[str, np.ndarray], batch_size: int = 8) -> float:
    """Fraction of answer positions where the draft's greedy token equals the target's."""
    n = len(targets["tokens"])
    batch_size = min(batch_size, n)
    order = np.concatenate([np.arange(n), np.arange(-n % batch_size)])  # pad with repeats ...
    weight = np.concatenate([np.ones(n), np.zeros(-n % batch_size)])  # ... that count zero
    hits = total = 0.0
    vocab_ids = jnp.asarray(draft.vocab_ids)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = {k: targets[k][rows] for k in ("tokens", "teacher_top1", "answer")}
        batch["answer"] = batch["answer"] * weight[start : start + batch_size, None]
        h, t = _agreement_counts(draft.params, draft.config, vocab_ids, batch)
        hits, total = hits + float(h), total + float(t)
    return hits / max(total, 1.0)


def training_schedule(cfg, n: int) -> tuple[int, int, optax.GradientTransformation]:
    """(batch size, steps per epoch, optimizer) for `n` training sequences: AdamW with a
    linear warmup over the first 5% of steps, cosine decay to 10% of `cfg.lr`, and gradient
    clipping (any config with lr, weight_decay, clip_norm, batch_size and epochs)."""
    batch_size = min(cfg.batch_size, n)
    steps_per_epoch = n // batch_size
    total_steps = cfg.epochs * steps_per_epoch
    warmup = max(1, total_steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup_steps=warmup,
                                                  decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * 0.1)
    return batch_size, steps_per_epoch, optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                                                    optax.adamw(schedule, weight_decay=cfg.weight_decay))


def train(draft: DraftModel, train_targets: dict[str, np.ndarray], cfg: DraftTrainingConfig,
          held_out: dict[str, np.ndarray] | None = None, log: Log | None = None) -> tuple[DraftModel, list[dict]]:
    """Distil into `draft` for `cfg.epochs` epochs -> (trained draft, per-epoch figures)."""
    n = len(train_targets["tokens"])
    batch_size, steps_per_epoch, optimizer = training_schedule(cfg, n)
    frozen, config = draft.params, draft.config

    @jax.jit
    def step(weights, opt_state, batch):
        loss, grads = jax.value_and_grad(distill_loss)(weights, frozen, config, batch)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, loss

    weights = trainable(draft)
    opt_state = optimizer.init(weights)
    rng = np.random.default_rng(cfg.seed)
    history = []
    for epoch in range(cfg.epochs):
        start, losses = time.perf_counter(), []
        for batch in _batches(train_targets, batch_size, rng.permutation(n)):
            weights, opt_state, loss = step(weights, opt_state, batch)
            losses.append(float(loss))
        figures = {"epoch": epoch + 1, "loss": float(np.mean(losses)), "seconds": time.perf_counter() - start}
        if held_out is not None:
            figures["held_out_top1"] = top1_agreement(with_trainable(draft, weights), held_out)
        history.append(figures)
        if log is not None:
            log("epoch {epoch}: loss {loss:.4f}, {seconds:.0f} s".format(**figures)
                + (f", held-out top-1 agreement {figures['held_out_top1']:.4f}" if held_out is not None else ""))
    return with_trainable(draft, weights), history


# ---- the whole procedure --------------------------------------------------------------------


def train_draft(target: Model, cfg: DraftTrainingConfig = DraftTrainingConfig(),
                prompts: Sequence[str | Sequence[int]] | None = None, chat: bool | None = None,
                log: Log | None = None) -> tuple[DraftModel, dict]:
    """Generate data with `target`, distil a draft from it -> (trained draft, figures for draft.json).

    `prompts` defaults to the first `cfg.num_prompts` of `DEFAULT_PROMPTS`; token-id prompts
    suit targets without a tokenizer. `chat` (default: when the tokenizer has a chat template)
    applies the chat template to text prompts.
    """
    progress, log = log is not None, log or (lambda msg: None)
    tc = target.config  # what depends on the target, checked before the generation (minutes to an hour)
    if not 1 <= cfg.n_layers <= tc.n_layers:
        raise ValueError(f"n_layers={cfg.n_layers} must be in [1, {tc.n_layers}] (the target's layers)")
    check_vocab_subset(cfg.vocab_subset, tc.vocab_size)
    t0 = time.perf_counter()
    if prompts is None:
        if cfg.num_prompts > len(DEFAULT_PROMPTS):
            raise ValueError(f"num_prompts={cfg.num_prompts} exceeds the {len(DEFAULT_PROMPTS)} built-in prompts")
        prompts = DEFAULT_PROMPTS[: cfg.num_prompts]
    if chat is None:
        tok = target.tokenizer
        chat = tok is not None and tok.chat_template is not None and all(isinstance(p, str) for p in prompts)

    log(f"generating {len(prompts)} prompts x temperatures {cfg.temperatures}, {cfg.new_tokens} new tokens each")
    sequences, prompt_lengths, prompt_index = generate_sequences(target, prompts, cfg.new_tokens, cfg.temperatures,
                                                                 cfg.seed, chat, progress=progress)
    t_gen = time.perf_counter()
    data = build_distill_data(target, sequences, prompt_lengths, prompt_index, cfg.top_k, log=log)
    t_teach = time.perf_counter()
    log(f"data: {len(sequences)} sequences, {data.num_tokens} tokens; generation {t_gen - t0:.0f} s, "
        f"teacher {t_teach - t_gen:.0f} s")

    train_rows, held_rows = held_out_split(data.prompt_index, cfg.holdout_every)
    vocab_ids = frequency_ranked_vocab([sequences[i] for i in train_rows], target.config.vocab_size,
                                       cfg.vocab_subset)
    train_targets = subset_targets(data.rows(train_rows), vocab_ids, target.config.vocab_size)
    held_targets = subset_targets(data.rows(held_rows), vocab_ids, target.config.vocab_size)

    draft = init_draft(target, cfg.n_layers, vocab_ids)
    init_top1 = top1_agreement(draft, held_targets)
    log(f"untrained draft (target's first {cfg.n_layers} layers): held-out top-1 agreement {init_top1:.4f}")
    draft, history = train(draft, train_targets, cfg, held_targets, log)
    seconds = {"generate": t_gen - t0, "teacher": t_teach - t_gen, "train": time.perf_counter() - t_teach,
               "total": time.perf_counter() - t0}
    return draft, {
        "config": dataclasses.asdict(cfg),
        "sequences": len(sequences), "train_sequences": len(train_rows), "held_out_sequences": len(held_rows),
        "tokens": data.num_tokens, "train_tokens": int(data.lengths[train_rows].sum()),
        "held_out_tokens": int(data.lengths[held_rows].sum()),
        "held_out_answer_positions": int(held_targets["answer"].sum()),
        "subset_coverage_held_out": subset_coverage(held_targets, vocab_ids),
        "init_held_out_top1": init_top1, "epochs": history, "final_held_out_top1": history[-1]["held_out_top1"],
        "seconds": seconds,
    }
