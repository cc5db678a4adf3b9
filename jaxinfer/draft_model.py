"""Moved to `jaxinfer.speculative.drafts`; kept for one release."""

from jaxinfer.speculative.drafts.model import DraftModel, check_draft_compatible, self_draft

__all__ = ["DraftModel", "check_draft_compatible", "self_draft"]
