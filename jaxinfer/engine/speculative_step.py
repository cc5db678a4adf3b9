"""Moved to `jaxinfer.speculative.step` (and `drafts.propose`); kept for one release."""

from jaxinfer.speculative.drafts.propose import sample_draft
from jaxinfer.speculative.step import DraftBatch, SpeculativeOutput, speculative_step

__all__ = ["DraftBatch", "SpeculativeOutput", "sample_draft", "speculative_step"]
