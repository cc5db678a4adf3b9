"""Train a small draft model for speculative decoding by self-distillation, and load it.

The draft (`DraftModel`, see `jaxinfer.draft_model`) is a Llama-family network with the
target's width, heads and FFN size but only `n_layers` layers (2 by default):

    tokens ──> target embedding (shared, frozen, not stored)
           ──> n_layers decoder layers      (trainable; initialised from the target's first n)
           ──> final RMSNorm                (trainable; initialised from the target's)
           ──> LM head over a vocab subset  (frozen, not stored: target head rows `vocab_ids`)
           ──> logits f32[..., Vd]          (index i scores token vocab_ids[i])

`vocab_ids` are the `vocab_subset` most frequent token ids of the training data (FR-Spec),
ties broken by the smaller id. Training data is the target's own text:

1. `generate_sequences`: the target answers a fixed list of instructions (chat template)
   greedily and, twice, at temperature 0.8 (fixed seeds); we keep prompt + answer ids.
2. `teacher_targets`: one teacher-forced dense forward of the target over those sequences
   stores, per position, its top-k next-token ids and log-probs (small).
3. `train`: AdamW (cosine schedule, gradient clipping) on the cross-entropy of the draft's
   subset distribution against the teacher's top-k restricted and renormalised to the subset.
   Held-out sequences (whole prompts) give the greedy top-1 agreement: the fraction of
   positions where the draft's argmax token is the target's argmax token, a proxy for the
   greedy acceptance rate of each drafted token.

`save_trained_draft` / `load_trained_draft` keep only the trainable weights (bf16) and
`vocab_ids` in an orbax directory, plus `draft.json`:

    path/
      params/      orbax StandardCheckpointer: {"layers": {"0": {field: bf16[...]}, ...},
                                                "final_norm": bf16[D], "vocab_ids": i32[Vd]}
      draft.json   format, n_layers, the target's shape and name, training figures
                   (written last: only a complete save has it)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jaxinfer.config import ModelConfig
from jaxinfer.draft_model import DraftModel
from jaxinfer.loading import Model
from jaxinfer.model.layers import apply_rope, linear, rms_norm, rope_inv_freq, swiglu_mlp
from jaxinfer.model.params import LayerParams, ModelParams, expected_shapes

DEFAULT_DRAFT_PATH = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2_draft"
DRAFT_FORMAT = "jaxinfer-trained-draft"
DRAFT_VERSION = 1
DRAFT_FILE = "draft.json"
PARAMS_DIR = "params"
STORED_DTYPE = jnp.bfloat16
# Target fields the draft's weights and head depend on: a target must match them all.
TARGET_SHAPE_FIELDS = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "attn_bias")

Log = Callable[[str], None]

# Instructions the target answers to make the training text: varied genres and lengths.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works in simple terms.",
    "List five tips for staying productive when working from home.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a polite email asking my manager for a day off next Friday.",
    "What is the capital of Australia, and why was it chosen?",
    "Describe the water cycle step by step.",
    "Give me a recipe for a simple vegetable soup.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a haiku about autumn leaves.",
    "What are the main causes of climate change?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do vaccines help the immune system?",
    "Write a limerick about a cat who loves cheese.",
    "Explain what a black hole is to a ten-year-old.",
    "List the planets of the solar system in order from the sun.",
    "Write a SQL query that returns the ten most recent orders from an orders table.",
    "What are three benefits of regular exercise?",
    "Write a short poem about the ocean at night.",
    "How does a bicycle stay upright when it moves?",
    "Write a thank-you note to a friend who helped me move house.",
    "Explain recursion with a simple example.",
    "What is the difference between weather and climate?",
    "Give me five ideas for a birthday party for a seven-year-old.",
    "Write a JavaScript function that returns the largest number in an array.",
    "Why is the sky blue?",
    "Describe a typical day in the life of a medieval farmer.",
    "Write a product description for a reusable water bottle.",
    "What should I pack for a weekend hiking trip?",
    "Explain how a neural network learns, in plain language.",
    "Write a dialogue between a teacher and a student about homework.",
    "What are the health benefits of drinking water?",
    "Give me a step-by-step guide to changing a flat tire.",
    "Write a short fairy tale about a brave mouse.",
    "Explain the rules of chess briefly.",
    "What is the Pythagorean theorem? Give an example.",
    "Write a cover letter opening paragraph for a junior software developer job.",
    "List some common mistakes people make when learning a new language.",
    "How do bees make honey?",
    "Write a Python class representing a bank account with deposit and withdraw methods.",
    "What happened during the French Revolution? Keep it short.",
    "Describe the taste of a lemon to someone who has never had one.",
    "Give three tips for writing a good essay.",
    "Explain what inflation is and how it affects people.",
    "Write a motivational message for someone starting a new job.",
    "How does the internet work, in simple terms?",
    "Write a short mystery story set on a train.",
    "What are the differences between cats and dogs as pets?",
    "Explain how to make a cup of tea.",
    "Write a bash command that counts the lines in all .txt files in a folder.",
    "What is machine learning?",
    "Describe your ideal vacation destination.",
    "List the steps to plant a tree.",
    "Write an apology email to a customer whose order arrived late.",
    "Why do we have seasons on Earth?",
    "Give me a workout plan for beginners, three days a week.",
    "Explain the difference between HTTP and HTTPS.",
    "Write a short speech for a friend's wedding.",
    "What are some good habits for a healthy sleep?",
    "Tell me an interesting fact about octopuses.",
    "Write a function in C that reverses a string in place.",
    "How do airplanes fly?",
    "Write a story about a lost dog finding its way home.",
    "What is the role of the heart in the human body?",
    "Give me a list of ten healthy snacks.",
    "Explain what an API is to a non-programmer.",
    "Write a review of an imaginary restaurant.",
    "How can I reduce plastic waste at home?",
    "What is the theory of evolution?",
    "Write a short dialogue between two astronauts on Mars.",
    "Explain how compound interest works with an example.",
    "Write a Python script that reads a CSV file and prints the average of a column.",
    "What are the symptoms of the common cold?",
    "Describe the city of Paris to a tourist.",
    "Write a bedtime story about the moon and the stars.",
    "What are the pros and cons of electric cars?",
    "Explain how to solve a quadratic equation.",
    "Write a short note reminding my team about tomorrow's meeting.",
    "Why is reading books important?",
    "Give me three ideas for a science fair project.",
    "Write a short story about a girl who discovers a secret garden.",
    "Explain how a refrigerator keeps food cold.",
    "List five famous painters and one work by each.",
    "Write a Python function that computes the Fibonacci numbers up to n.",
    "Write an email inviting colleagues to a team lunch on Thursday.",
    "What is the difference between a virus and a bacterium?",
    "Describe how to make pancakes from scratch.",
    "Explain what a prime number is and list the first ten.",
    "Write a poem about a rainy afternoon in the city.",
    "What are the main parts of a computer and what do they do?",
    "Give me advice on how to prepare for a job interview.",
    "Explain the difference between renewable and non-renewable energy.",
    "Write a short conversation between a customer and a shop assistant.",
    "How do plants know which way to grow?",
    "Write a function in Python that sorts a list of dictionaries by a key.",
    "What is democracy? Explain briefly.",
    "Describe the life cycle of a butterfly.",
    "Give me five tips for saving money each month.",
    "Write a short adventure story about pirates searching for treasure.",
    "Why do leaves change color in the fall?",
)


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


@dataclasses.dataclass(frozen=True)
class DistillData:
    """Padded sequences with the teacher's top-k next-token distribution at every position.

    Row n holds `lengths[n]` real tokens, the first `prompt_lengths[n]` of them the prompt;
    positions at or past `lengths[n]` are padding. Position t of `top_ids`/`top_logp` is the
    target's distribution of token t + 1.
    """

    tokens: np.ndarray  # i32[N, T]
    lengths: np.ndarray  # i32[N]
    top_ids: np.ndarray  # i32[N, T, K]: teacher's top-k token ids, most likely first
    top_logp: np.ndarray  # f32[N, T, K]: their log-probs (over the full vocabulary)
    prompt_index: np.ndarray  # i32[N]: which prompt the row answers (for the held-out split)
    prompt_lengths: np.ndarray  # i32[N]: tokens of the prompt; the answer follows

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def rows(self, index: np.ndarray) -> DistillData:
        return DistillData(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


# ---- the dense forward used for teaching and training --------------------------------------


def causal_mask(t: int, window: int | None) -> jax.Array:
    """bool[T, T]: query i sees key j iff j <= i (and i - j < window for a windowed layer)."""
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    mask = j <= i
    return mask if window is None else mask & (i - j < window)


def dense_attention(config: ModelConfig, layer: LayerParams, x: jax.Array, inv_freq: jax.Array,
                    mask: jax.Array) -> jax.Array:
    """Causal GQA self-attention over whole sequences, no cache: x f32[B, T, D] -> f32[B, T, D]."""
    c = config
    b, t, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # i32[B, T]
    q = linear(x, layer.wq, layer.bq).reshape(b, t, c.n_heads, c.head_dim)  # [B, T, H, Dh]
    k = linear(x, layer.wk, layer.bk).reshape(b, t, c.n_kv_heads, c.head_dim)  # [B, T, Hkv, Dh]
    v = linear(x, layer.wv, layer.bv).reshape(b, t, c.n_kv_heads, c.head_dim)  # [B, T, Hkv, Dh]
    # query head h reads KV head h // G (G = q_per_kv): split H into [Hkv, G]
    q = apply_rope(q, positions, inv_freq).reshape(b, t, c.n_kv_heads, c.q_per_kv, c.head_dim)  # [B, T, Hkv, G, Dh]
    k = apply_rope(k, positions, inv_freq)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(c.head_dim)
    scores = jnp.where(mask, scores, -jnp.inf)  # f32[B, Hkv, G, T, T]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)  # [B, T, Hkv, G, Dh]
    return linear(out.reshape(b, t, c.n_heads * c.head_dim), layer.wo)


def dense_hidden(params: ModelParams, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Final-normed hidden states of whole sequences: tokens i32[B, T] -> [B, T, D].

    The same layer math as `transformer.forward_groups`, but dense and differentiable
    (no paged cache). Right-padding is harmless: position t sees only tokens <= t.
    """
    c = config
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    x = params.embed[tokens].astype(c.jnp_dtype)  # [B, T, D]
    for i, layer in enumerate(params.layers):
        mask = causal_mask(tokens.shape[1], c.window(i))
        x = x + dense_attention(c, layer, rms_norm(x, layer.attn_norm, c.rms_eps), inv_freq, mask)
        x = x + swiglu_mlp(rms_norm(x, layer.mlp_norm, c.rms_eps), layer.w_gate, layer.w_up, layer.w_down)
    return rms_norm(x, params.final_norm, c.rms_eps)


def dense_logits(params: ModelParams, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens i32[B, T] -> logits f32[B, T, V] (V = the head's rows: a draft's subset)."""
    head = params.embed if params.lm_head is None else params.lm_head  # [V, D]
    return jnp.einsum("btd,vd->btv", dense_hidden(params, config, tokens), head, preferred_element_type=jnp.float32)


# ---- step 1: the target's own text -----------------------------------------------------------


def generate_sequences(target: Model, prompts: Sequence[str | Sequence[int]], new_tokens: int,
                       temperatures: Sequence[float], seed: int, chat: bool, max_slots: int = 48,
                       progress: bool = False) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Let the target answer every prompt at every temperature (sample seeds seed, seed+1, ...).

    48 slots: decoding on CPU is bound by reading the weights, so wider batches are
    nearly free (about 1.6x the tokens/s of 16 slots on a 2-core machine).

    Returns the token sequences (prompt + generated, i32[L] each), their prompt lengths
    i32[N] and the prompt index of each i32[N].
    """
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    jobs = [(i, t) for t in temperatures for i in range(len(prompts))]
    params = [SamplingParams(temperature=t, seed=seed + n, max_tokens=new_tokens) for n, (_, t) in enumerate(jobs)]
    max_len = min(target.config.max_position, 512)  # prompt + new_tokens must fit
    engine = Engine(target, EngineConfig(max_slots=max_slots, max_model_len=max_len, seed=seed))
    outputs = engine.generate([prompts[i] for i, _ in jobs], params, chat=chat, progress=progress)
    sequences = [np.asarray(o.prompt_token_ids + o.token_ids, np.int32) for o in outputs]
    prompt_lengths = np.asarray([len(o.prompt_token_ids) for o in outputs], np.int32)
    return sequences, prompt_lengths, np.asarray([i for i, _ in jobs], np.int32)


def frequency_ranked_vocab(sequences: Sequence[np.ndarray], vocab_size: int, n: int) -> np.ndarray:
    """i32[n]: the n most frequent token ids of `sequences`, most frequent first, ties by id.

    Ids that never occur rank after all that do (by id), so any n <= vocab_size works.
    """
    if not 1 <= n <= vocab_size:
        raise ValueError(f"vocab subset size {n} must be in [1, {vocab_size}]")
    counts = np.bincount(np.concatenate(sequences), minlength=vocab_size)  # i64[V]
    order = np.lexsort((np.arange(vocab_size), -counts))  # last key sorts first: count desc, then id
    return order[:n].astype(np.int32)


# ---- step 2: the teacher's next-token distributions ----------------------------------------


def pad_sequences(sequences: Sequence[np.ndarray], multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to a common length (a multiple of `multiple`) -> (i32[N, T], lengths i32[N])."""
    lengths = np.asarray([len(s) for s in sequences], np.int32)
    t = -(-int(lengths.max()) // multiple) * multiple
    tokens = np.zeros((len(sequences), t), np.int32)
    for row, s in zip(tokens, sequences):
        row[: len(s)] = s
    return tokens, lengths


def teacher_targets(target: Model, tokens: np.ndarray, top_k: int, batch_size: int = 4,
                    log: Log | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced target over tokens i32[N, T] -> (top_ids i32[N, T, K], top_logp f32[N, T, K])."""

    @jax.jit
    def top(params, batch):  # batch i32[B, T]
        logp = jax.nn.log_softmax(dense_logits(params, target.config, batch), axis=-1)  # f32[B, T, V]
        values, ids = jax.lax.top_k(logp, top_k)
        return ids.astype(jnp.int32), values

    ids, logps = [], []
    for start in range(0, len(tokens), batch_size):
        batch = tokens[start : start + batch_size]
        pad = batch_size - len(batch)  # a short last batch is padded, so one program compiles
        batch_ids, batch_logp = top(target.params, np.pad(batch, ((0, pad), (0, 0))))
        ids.append(np.asarray(batch_ids)[: len(batch)])
        logps.append(np.asarray(batch_logp)[: len(batch)])
        if log is not None and (start // batch_size % 10 == 9 or start + batch_size >= len(tokens)):
            log(f"teacher: {start + len(batch)}/{len(tokens)} sequences")
    return np.concatenate(ids), np.concatenate(logps)


def build_distill_data(target: Model, sequences: Sequence[np.ndarray], prompt_lengths: np.ndarray,
                       prompt_index: np.ndarray, top_k: int, log: Log | None = None) -> DistillData:
    tokens, lengths = pad_sequences(sequences)
    top_ids, top_logp = teacher_targets(target, tokens, top_k, log=log)
    return DistillData(tokens, lengths, top_ids, top_logp, np.asarray(prompt_index, np.int32),
                       np.asarray(prompt_lengths, np.int32))


# ---- step 3: the draft and its training ------------------------------------------------------


def init_draft(target: Model, n_layers: int, vocab_ids: np.ndarray) -> DraftModel:
    """The untrained draft: the target's first `n_layers` layers and final norm, with the
    target's head rows `vocab_ids` as its LM head (the target's tied embedding for SmolLM2)."""
    tc, tp = target.config, target.params
    if not 1 <= n_layers <= tc.n_layers:
        raise ValueError(f"n_layers={n_layers} must be in [1, {tc.n_layers}] (the target's layers)")
    if tc.mla is not None:
        raise ValueError("training a draft for an MLA target is not supported")
    config = tc.replace(n_layers=n_layers, layer_windows=tc.layer_windows[:n_layers])
    head = tp.embed if tp.lm_head is None else tp.lm_head  # [V, D]
    vocab_ids = np.asarray(vocab_ids, np.int32)
    params = ModelParams(embed=tp.embed, layers=tuple(tp.layers[:n_layers]), final_norm=tp.final_norm,
                         lm_head=head[jnp.asarray(vocab_ids)])
    return DraftModel(config, params, vocab_ids=vocab_ids, name="trained")


def subset_targets(data: DistillData, vocab_ids: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
    """The teacher's top-k restricted to the draft's subset and renormalised.

    Returns per position: `index` i32[N, T, K] (subset index; 0 where the token is outside),
    `prob` f32[N, T, K] (0 outside the subset; each position sums to 1 or, when none of its
    top-k is in the subset, to 0), `weight` f32[N, T] (training: 1 at real positions with
    some subset mass), `answer` f32[N, T] (evaluation: 1 at the positions that predict a
    generated token, prompt_len - 1 <= t < len - 1), `teacher_top1` i32[N, T] and the `tokens`.
    """
    lookup = np.full(vocab_size, -1, np.int32)
    lookup[vocab_ids] = np.arange(len(vocab_ids), dtype=np.int32)
    index = lookup[data.top_ids]  # i32[N, T, K], -1 outside the subset
    prob = np.where(index >= 0, np.exp(data.top_logp), 0.0).astype(np.float32)
    total = prob.sum(-1)  # f32[N, T]
    t = np.arange(data.tokens.shape[1])[None, :]  # [1, T]
    real = t < data.lengths[:, None]
    answer = (t >= data.prompt_lengths[:, None] - 1) & (t < data.lengths[:, None] - 1)
    prob = prob / np.maximum(total, 1e-30)[..., None]
    return dict(index=np.maximum(index, 0), prob=prob, weight=(real & (total > 0)).astype(np.float32),
                answer=answer.astype(np.float32),
                teacher_top1=data.top_ids[..., 0], tokens=data.tokens)


def trainable(draft: DraftModel) -> dict:
    """The weights training updates: the layers and the final norm."""
    return {"layers": draft.params.layers, "final_norm": draft.params.final_norm}


def with_trainable(draft: DraftModel, weights: dict) -> DraftModel:
    params = dataclasses.replace(draft.params, layers=tuple(weights["layers"]), final_norm=weights["final_norm"])
    return dataclasses.replace(draft, params=params)


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


def train(draft: DraftModel, train_targets: dict[str, np.ndarray], cfg: DraftTrainingConfig,
          held_out: dict[str, np.ndarray] | None = None, log: Log | None = None) -> tuple[DraftModel, list[dict]]:
    """Distil into `draft` for `cfg.epochs` epochs -> (trained draft, per-epoch figures)."""
    n = len(train_targets["tokens"])
    batch_size = min(cfg.batch_size, n)
    steps_per_epoch = n // batch_size
    total_steps = cfg.epochs * steps_per_epoch
    warmup = max(1, total_steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup_steps=warmup,
                                                  decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                            optax.adamw(schedule, weight_decay=cfg.weight_decay))
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


def held_out_split(prompt_index: np.ndarray, every: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows): every `every`-th prompt is held out with all its samples,
    so held-out text answers instructions never trained on. With too few prompts for that,
    the last row alone is held out."""
    held = prompt_index % every == every - 1
    if held.all() or not held.any():
        held = np.arange(len(held)) == len(held) - 1
    return np.flatnonzero(~held), np.flatnonzero(held)


def subset_coverage(targets: dict[str, np.ndarray], vocab_ids: np.ndarray) -> float:
    """Fraction of answer positions whose teacher argmax token is in the subset: the ceiling
    of the draft's top-1 agreement (it never proposes a token outside the subset)."""
    inside = np.isin(targets["teacher_top1"], vocab_ids) * targets["answer"]
    return float(inside.sum() / max(targets["answer"].sum(), 1.0))


# ---- save / load ----------------------------------------------------------------------------


def _stored_tree(layers, final_norm, vocab_ids) -> dict:
    return {"layers": {str(i): dataclasses.asdict(layer) for i, layer in enumerate(layers)},
            "final_norm": final_norm, "vocab_ids": vocab_ids}


def _drop_none(tree: dict) -> dict:
    """Leave out absent biases (None fields): orbax stores arrays only."""
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in tree.items() if v is not None}


def save_trained_draft(draft: DraftModel, target: Model, path: str | Path, figures: dict | None = None) -> Path:
    """Write the draft's trainable weights (bf16) and vocab_ids to a new directory `path`."""
    path = Path(path).absolute()
    if draft.vocab_ids is None:
        raise ValueError("a trained draft needs vocab_ids (its LM head is rebuilt from them on load)")
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty")
    path.mkdir(parents=True, exist_ok=True)
    cast = lambda a: jnp.asarray(a, STORED_DTYPE)  # noqa: E731
    tree = _stored_tree(jax.tree.map(cast, draft.params.layers), cast(draft.params.final_norm),
                        jnp.asarray(draft.vocab_ids, jnp.int32))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / PARAMS_DIR, _drop_none(tree))
    tc = target.config
    info = {
        "format": DRAFT_FORMAT, "version": DRAFT_VERSION, "n_layers": draft.config.n_layers,
        "vocab_subset": len(draft.vocab_ids), "stored_dtype": jnp.dtype(STORED_DTYPE).name,
        "target": {"name": Path(target.source).name if target.source else "", "arch": tc.arch,
                   **{f: getattr(tc, f) for f in TARGET_SHAPE_FIELDS}},
        "training": figures or {},
    }
    (path / DRAFT_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return path


def read_draft_info(path: str | Path) -> dict:
    """The `draft.json` of a trained-draft directory (checks the format)."""
    file = Path(path) / DRAFT_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path}: not a trained draft directory (no {DRAFT_FILE})")
    info = json.loads(file.read_text())
    if (info.get("format"), info.get("version")) != (DRAFT_FORMAT, DRAFT_VERSION):
        raise ValueError(f"{file}: unsupported draft format {info.get('format')!r} v{info.get('version')!r}")
    return info


def check_target_matches(info: dict, target_config: ModelConfig) -> None:
    """Raise ValueError naming every field where `target_config` differs from the draft's target."""
    want = info["target"]
    bad = [f"{f}: draft trained for {want[f]!r}, target has {getattr(target_config, f)!r}"
           for f in TARGET_SHAPE_FIELDS if want[f] != getattr(target_config, f)]
    if target_config.mla is not None:
        bad.append("mla: an MLA target is not supported")
    if bad:
        raise ValueError("trained draft does not match the target model (" + "; ".join(bad) + ")")


def load_trained_draft(target: Model, path: str | Path = DEFAULT_DRAFT_PATH) -> DraftModel:
    """Load a draft written by `save_trained_draft` for `target`, in the target's dtype.

    The embedding is the target's and the LM head is rebuilt as the target's head rows
    `vocab_ids`. Raises ValueError when `target` is not the shape the draft was trained for.
    """
    path = Path(path).absolute()
    info = read_draft_info(path)
    check_target_matches(info, target.config)
    n_layers = info["n_layers"]
    config = target.config.replace(n_layers=n_layers, layer_windows=target.config.layer_windows[:n_layers])
    leaf = lambda shape: jax.ShapeDtypeStruct(shape, STORED_DTYPE)  # noqa: E731
    layer = {f: leaf(s) for f, s in expected_shapes(config).items()}
    abstract = _stored_tree([LayerParams(**layer)] * n_layers, leaf((config.d_model,)),
                            jax.ShapeDtypeStruct((info["vocab_subset"],), jnp.int32))
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.restore(path / PARAMS_DIR, _drop_none(abstract))
    dtype = config.jnp_dtype
    layers = tuple(LayerParams(**{f: jnp.asarray(a, dtype) for f, a in stored["layers"][str(i)].items()})
                   for i in range(n_layers))
    draft = init_draft(target, n_layers, np.asarray(stored["vocab_ids"], np.int32))
    return with_trainable(draft, {"layers": layers, "final_norm": jnp.asarray(stored["final_norm"], dtype)})
