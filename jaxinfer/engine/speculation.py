"""Moved to `jaxinfer.speculative` (config, drafts.ngram); kept for one release."""

from jaxinfer.speculative.config import METHODS, SpeculativeConfig, SpeculativeStats
from jaxinfer.speculative.drafts.ngram import propose_ngram

__all__ = ["METHODS", "SpeculativeConfig", "SpeculativeStats", "propose_ngram"]
