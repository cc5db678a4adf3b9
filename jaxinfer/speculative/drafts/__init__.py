"""Draft sources: each proposes k tokens per decoding slot and the q they were drawn from.

One interface, the `Proposal` verification takes (`jaxinfer.speculative.verify`)::

    tokens  i32[B, k]      proposed tokens (row b's entries past num_draft[b] are padding)
    q       f32[B, k, V]   the distribution each token was drawn from; None = one-hot at
                           the token (a deterministic draft: no V-sized array is built)
    q_vocab i32[Vd]        when q covers a vocabulary subset ([B, k, Vd]): its token ids

The sources differ only in where they propose:

- `ngram.NgramIndex` (prompt lookup; `propose_ngram` is the same search, stateless) runs on
  the host before the step, per request, updated incrementally as tokens append (it needs
  the request's token history, which lives on the host). The engine packs the tokens into
  `DraftBatch.tokens`; the step passes `Proposal(tokens, None)`.
- `propose.propose_with_model` runs a `DraftModel` k times inside the jitted step (its
  forwards need the device caches): a separate draft, a `self_draft` (the target's first
  layers) or a trained checkpoint (`jaxinfer.speculative.load_trained_draft`). It samples
  each token under the row's own parameters and returns its q.
- `jaxinfer.speculative.eagle` drafts with a one-layer head over the target's features,
  also inside the step (its own step function, `eagle_step`).
"""

from jaxinfer.speculative.drafts.model import DraftModel, check_draft_compatible, init_draft, self_draft
from jaxinfer.speculative.drafts.ngram import propose_ngram
from jaxinfer.speculative.drafts.propose import propose_with_model, sample_draft

__all__ = ["DraftModel", "check_draft_compatible", "init_draft", "propose_ngram", "propose_with_model",
           "sample_draft", "self_draft"]
