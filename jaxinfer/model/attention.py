"""Moved: the attention references live in `jaxinfer.attention.reference`; these re-exports
are kept for one release."""

from jaxinfer.attention.reference import (MASK_VALUE, attention_output, attention_scores, check_mask_options,
                                          mla_attention_reference, paged_attention_reference,
                                          streaming_attention_reference, visible_keys)

__all__ = ["MASK_VALUE", "attention_output", "attention_scores", "check_mask_options", "mla_attention_reference",
           "paged_attention_reference", "streaming_attention_reference", "visible_keys"]
