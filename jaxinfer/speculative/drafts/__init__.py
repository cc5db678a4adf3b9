"""Draft sources: each proposes k tokens per decoding slot and the q they were drawn from.

One interface, the `Proposal` verification takes (`jaxinfer.speculative.verify`)::

    tokens  i32[B, k]      proposed tokens (row b's entries past num_draft[b] are padding)
    q       f32[B, k, V]   the distribution each token was drawn from; None = one-hot at
                           the token (a deterministic draft: no V-sized array is built)

The sources differ only in where they propose:

- `ngram.propose_ngram` (prompt lookup) runs on the host before the step, per request
  (it needs the request's token history, which lives on the host). The engine packs the
  tokens into `DraftBatch.tokens`; the step passes `Proposal(tokens, None)`.
- `propose.propose_with_model` runs a `DraftModel` k times inside the jitted step (its
  forwards need the device caches): a separate draft, a `self_draft` (the target's first
  layers) or a trained checkpoint (`jaxinfer.speculative.load_trained_draft`). It samples
  each token under the row's own parameters and returns its q.
"""

from jaxinfer.speculative.drafts.model import DraftModel, check_draft_compatible, init_draft, self_draft
from jaxinfer.speculative.drafts.ngram import propose_ngram
from jaxinfer.speculative.drafts.propose import propose_with_model, sample_draft

__all__ = ["DraftModel", "check_draft_compatible", "init_draft", "propose_ngram", "propose_with_model",
           "sample_draft", "self_draft"]
