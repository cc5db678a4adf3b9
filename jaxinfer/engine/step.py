"""Moved to `jaxinfer.step`; kept for one release."""

from jaxinfer.step import PrefillBatch, StepBatch, StepOutput, engine_step, prefill_groups, sample_prefill, step_logprobs

__all__ = ["PrefillBatch", "StepBatch", "StepOutput", "engine_step", "prefill_groups", "sample_prefill",
           "step_logprobs"]
