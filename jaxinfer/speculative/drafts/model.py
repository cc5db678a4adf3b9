"""Draft models: small networks that share the target's tokenizer (run by `drafts.propose`).

A `DraftModel` is an ordinary Llama-family `ModelParams` + `ModelConfig`, run by the same
`forward_groups` as the target, with one twist: its LM head may cover only a subset of
the target's vocabulary (`vocab_ids`, the most frequent tokens, as in FR-Spec). The head
over 49152 tokens costs as much as eight of SmolLM2's layers, so a draft that scores
8192 tokens is several times cheaper; tokens outside the subset get draft probability 0,
which verification handles exactly (it simply never proposes them).

Ways to get one:
- `DraftModel(config, params)`: any Llama-family model with the target's vocabulary;
  `DraftModel.with_vocab_subset(config, params, vocab_ids)` cuts its head to a subset;
- `self_draft(target, n)`: the target's first `n` layers, final norm and LM head (no new
  weights; its KV is the target's own first `n` layers, shared in the cache);
- `jaxinfer.speculative.load_trained_draft(target, path)`: a small draft trained by
  self-distillation (`jaxinfer train-draft`), e.g. the one shipped in `checkpoints/`
  (`init_draft` below, with the trained layers and norm).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.layer_stack import slice_layers, unstack
from jaxinfer.loading import Model
from jaxinfer.model.params import ModelParams, lm_head_weight


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A proposer network for speculative decoding.

    `params.lm_head` is `[len(vocab_ids), d_model]` when `vocab_ids` is set (its logits
    index into `vocab_ids`), else the usual full-vocabulary head (or tied embedding).
    `shares_target_layers=n` marks a self-speculative draft: its layers are the target's
    first `n`, so it reads and writes the target's own KV pages for those layers.
    """

    config: ModelConfig
    params: ModelParams
    vocab_ids: np.ndarray | None = None  # i32[Vd]: target token id of each draft logit
    shares_target_layers: int = 0
    name: str = "draft"

    def __post_init__(self) -> None:
        if self.vocab_ids is not None:
            ids = np.asarray(self.vocab_ids)
            if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(np.unique(ids)) != len(ids):
                raise ValueError("DraftModel.vocab_ids must be a 1-D array of distinct token ids")
            if ids.min() < 0 or ids.max() >= self.config.vocab_size:
                raise ValueError(f"DraftModel.vocab_ids must lie in [0, {self.config.vocab_size})")

    @classmethod
    def with_vocab_subset(cls, config: ModelConfig, params: ModelParams, vocab_ids, name: str = "draft") -> DraftModel:
        """A draft whose head scores only `vocab_ids` (i32[Vd]): the rows `vocab_ids` of the
        full-vocabulary head in `params` (its LM head, or the tied embedding), so logit i is
        the full head's logit of token vocab_ids[i]. The embedding stays whole (any token
        can be an input)."""
        ids = np.asarray(vocab_ids, np.int32)
        head = lm_head_weight(params)  # [V, D]
        if head.shape[0] != config.vocab_size:
            raise ValueError(f"params' head has {head.shape[0]} rows, not the vocabulary's {config.vocab_size}: "
                             "with_vocab_subset cuts a full-vocabulary head")
        return cls(config, dataclasses.replace(params, lm_head=head[ids]), vocab_ids=ids, name=name)


def check_draft_compatible(draft: DraftModel, target_config: ModelConfig) -> None:
    """A draft must propose token ids of the target's vocabulary (same tokenizer)."""
    if draft.config.vocab_size != target_config.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target_config.vocab_size}): a draft must share the target's tokenizer")
    if draft.config.mla is not None:
        raise ValueError("an MLA draft model is not supported")


def self_draft(target_config: ModelConfig, target_params: ModelParams, num_layers: int) -> DraftModel:
    """Self-speculation: the target's first `num_layers` layers + its final norm and head."""
    if not isinstance(num_layers, int) or not 1 <= num_layers < target_config.n_layers:
        raise ValueError(f"self-speculation needs 1 <= num_layers < {target_config.n_layers}, got {num_layers!r}")
    if target_config.mla is not None:
        raise ValueError("self-speculation is not supported for MLA models")
    config = dataclasses.replace(
        target_config, n_layers=num_layers,
        layer_windows=target_config.layer_windows[:num_layers] if target_config.layer_windows else (),
    )
    params = dataclasses.replace(target_params, layers=slice_layers(target_params.layers, 0, num_layers))
    return DraftModel(config, params, shares_target_layers=num_layers, name=f"self{num_layers}")


def init_draft(target: Model, n_layers: int, vocab_ids: np.ndarray) -> DraftModel:
    """The untrained draft of a trained-draft checkpoint: the target's first `n_layers`
    layers and final norm, with the target's head rows `vocab_ids` as its LM head (the
    target's tied embedding for SmolLM2). Unlike `self_draft` it has pages of its own."""
    tc, tp = target.config, target.params
    if not 1 <= n_layers <= tc.n_layers:
        raise ValueError(f"n_layers={n_layers} must be in [1, {tc.n_layers}] (the target's layers)")
    if tc.mla is not None:
        raise ValueError("training a draft for an MLA target is not supported")
    config = tc.replace(n_layers=n_layers, layer_windows=tc.layer_windows[:n_layers])
    params = dataclasses.replace(tp, layers=unstack(slice_layers(tp.layers, 0, n_layers)))  # training walks layers
    return DraftModel.with_vocab_subset(config, params, vocab_ids, name="trained")
