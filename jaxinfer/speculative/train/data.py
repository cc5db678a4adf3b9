"""Distillation data: the target's own text and its next-token distributions over it.

1. `generate_sequences`: the target answers the instructions (chat template) greedily and
   at the sampling temperatures (fixed seeds); we keep prompt + answer ids. Instructions are
   built in (`prompts`) or written by the target itself (`self_written_prompts`).
2. `build_distill_data` / `teacher_targets`: one teacher-forced dense forward of the target
   over those sequences stores, per position, its top-k next-token ids and log-probs.
3. `subset_targets`: the teacher's top-k restricted to the draft's vocabulary subset
   (`frequency_ranked_vocab`) and renormalised: what the draft's loss compares against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.loading import Model
from jaxinfer.speculative.train.dense import dense_logits

Log = Callable[[str], None]


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


def self_written_prompts(target: Model, n: int, seed: int, max_tokens: int = 64, max_slots: int = 32,
                         progress: bool = False) -> tuple[str, ...]:
    """n distinct instructions the target writes itself (Magpie, Xu et al. 2024).

    An instruction-tuned model given only its chat template up to the user's turn writes a
    user's request: sampled at temperature 1 (top-p 0.95, seeds seed, seed+1, ...) they are
    far more varied than templated instructions. Kept: turns the model ended itself, of 3 to
    80 words, each once (case-insensitive). Raises ValueError if 4 rounds of sampling do not
    give n of them.
    """
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    tok = target.tokenizer
    if tok is None or tok.chat_template is None:
        raise ValueError("self-written prompts need a model with a tokenizer and a chat template "
                         "(train with self_prompts=0, `--self-prompts 0`)")
    marker = "\x00"
    rendered = tok.apply_chat_template([{"role": "user", "content": marker}])
    pre_query = tok.encode(rendered[: rendered.index(marker)], add_special_tokens=False)
    engine = Engine(target, EngineConfig(max_slots=max_slots, max_model_len=len(pre_query) + max_tokens, seed=seed))
    kept: dict[str, str] = {}
    sampled = 0
    for _ in range(4):
        batch = max(n - len(kept), 1) * 5 // 4 + 8  # about 1 in 5 runs past max_tokens or repeats
        params = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed + sampled + i, max_tokens=max_tokens)
                  for i in range(batch)]
        sampled += batch
        for out in engine.generate([pre_query] * batch, params, chat=False, progress=progress):
            text = out.text.strip()
            if out.finish_reason == "stop" and 3 <= len(text.split()) <= 80 and text.lower() not in kept:
                kept[text.lower()] = text
        if len(kept) >= n:
            return tuple(kept.values())[:n]
    raise ValueError(f"the model wrote only {len(kept)} usable prompts in {sampled} tries; asked for {n}")


def check_vocab_subset(n: int, vocab_size: int) -> None:
    if not 1 <= n <= vocab_size:
        raise ValueError(f"vocab subset size {n} must be in [1, {vocab_size}]")


def frequency_ranked_vocab(sequences: Sequence[np.ndarray], vocab_size: int, n: int) -> np.ndarray:
    """i32[n]: the n most frequent token ids of `sequences`, most frequent first, ties by id.

    Ids that never occur rank after all that do (by id), so any n <= vocab_size works.
    """
    check_vocab_subset(n, vocab_size)
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


# ---- step 3: the draft's view of the teacher -------------------------------------------------


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
