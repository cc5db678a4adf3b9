"""Train a small draft model for speculative decoding by self-distillation.

Used by the CLI (`jaxinfer train-draft`) and notebooks only: serving never imports it (it
loads trained drafts with `jaxinfer.speculative.checkpoint`). The draft (`DraftModel`) is a
Llama-family network with the target's width, heads and FFN size but only `n_layers`
layers (2 by default)::

    tokens ──> target embedding (shared, frozen, not stored)
           ──> n_layers decoder layers      (trainable; initialised from the target's first n)
           ──> final RMSNorm                (trainable; initialised from the target's)
           ──> LM head over a vocab subset  (frozen, not stored: target head rows `vocab_ids`)
           ──> logits f32[..., Vd]          (index i scores token vocab_ids[i])

`vocab_ids` are the `vocab_subset` most frequent token ids of the training data (FR-Spec),
ties broken by the smaller id. Modules: `prompts` (the instructions), `data` (the target's
text and its top-k distributions), `dense` (the cache-free forward both models run),
`loop` (AdamW, held-out agreement, `train_draft` end to end); the result is written with
`checkpoint.save_trained_draft`.
"""

from jaxinfer.speculative.checkpoint import (DEFAULT_DRAFT_PATH, load_trained_draft, read_draft_info,
                                             save_trained_draft, trainable, with_trainable)
from jaxinfer.speculative.drafts.model import init_draft
from jaxinfer.speculative.train.data import (DistillData, build_distill_data, frequency_ranked_vocab,
                                             generate_sequences, held_out_split, pad_sequences, self_written_prompts,
                                             subset_coverage, subset_targets, teacher_targets)
from jaxinfer.speculative.train.dense import causal_mask, dense_attention, dense_hidden, dense_logits
from jaxinfer.speculative.train.loop import DraftTrainingConfig, distill_loss, top1_agreement, train, train_draft
from jaxinfer.speculative.train.prompts import DEFAULT_PROMPTS

__all__ = [
    "DEFAULT_DRAFT_PATH", "DEFAULT_PROMPTS", "DistillData", "DraftTrainingConfig", "build_distill_data",
    "causal_mask", "dense_attention", "dense_hidden", "dense_logits", "distill_loss", "frequency_ranked_vocab",
    "generate_sequences", "held_out_split", "init_draft", "load_trained_draft", "pad_sequences", "read_draft_info",
    "save_trained_draft", "self_written_prompts", "subset_coverage", "subset_targets", "teacher_targets",
    "top1_agreement", "train", "train_draft", "trainable", "with_trainable",
]
