"""Speculative decoding: a cheap draft proposes k tokens, the target verifies them in one pass.

    config      SpeculativeConfig (what an engine speculates with), SpeculativeStats
    verify      rejection sampling (pure): verify_draft, verify_step, the `Proposal` form
    drafts/     the draft sources: n-gram prompt lookup, DraftModel, self_draft
    checkpoint  trained-draft checkpoints (load_trained_draft, DEFAULT_DRAFT_PATH)
    step        the jitted speculative step the engine runs
    train/      draft training (`jaxinfer train-draft`); not imported here, nor by serving

Layering: model -> step (jaxinfer.step) -> speculative -> engine -> server / cli.
"""

from jaxinfer.speculative.checkpoint import DEFAULT_DRAFT_PATH, load_trained_draft
from jaxinfer.speculative.config import SpeculativeConfig, SpeculativeStats
from jaxinfer.speculative.drafts import DraftModel, check_draft_compatible, propose_ngram, self_draft
from jaxinfer.speculative.verify import (Proposal, acceptance_probs, residual_distribution, sampling_probs,
                                         verify_draft, verify_step)

__all__ = [
    "DEFAULT_DRAFT_PATH", "DraftModel", "Proposal", "SpeculativeConfig", "SpeculativeStats", "acceptance_probs",
    "check_draft_compatible", "load_trained_draft", "propose_ngram", "residual_distribution", "sampling_probs",
    "self_draft", "verify_draft", "verify_step",
]
