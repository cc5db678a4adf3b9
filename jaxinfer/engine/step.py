"""Moved to `jaxinfer.step`; kept for one release."""

from jaxinfer.step import PrefillBatch, StepBatch, StepOutput, engine_step, prefill_groups, prefill_logprobs, sample_prefill

__all__ = ["PrefillBatch", "StepBatch", "StepOutput", "engine_step", "prefill_groups", "prefill_logprobs",
           "sample_prefill"]
