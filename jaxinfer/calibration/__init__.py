"""Explicit error budgets for the KV cache: measure what each format does to a model, then plan.

    calib = calibrate_kv(params, config, tokens)            # tokens: i32[N, T] of real text
    plan = plan_within_budget(params, config, tokens, calib, budget_kl=0.01)
    plan.save("plan.json")                                   # init_paged_kv(..., kv_cache="plan.json")

    measure.py   per-layer / per-head errors of each format, end-to-end KL, evaluation
    planner.py   the knapsack over bytes, verified plans, the `jaxinfer calibrate-kv` procedure

It runs the model, so it sits above `jaxinfer.model` (the cache formats in `jaxinfer.kv` know
nothing of models).
"""

from jaxinfer.calibration.measure import (KVCalibration, calibrate_kv, capture_attention_inputs, english_text,
                                          evaluate_kv_cache, logprob_stats, measure_plans, reference_logits,
                                          text_tokens)
from jaxinfer.calibration.planner import calibrate_plan, choose_formats, plan_kv_cache, plan_within_budget

__all__ = ["KVCalibration", "calibrate_kv", "calibrate_plan", "capture_attention_inputs", "choose_formats",
           "english_text", "evaluate_kv_cache", "logprob_stats", "measure_plans", "plan_kv_cache",
           "plan_within_budget", "reference_logits", "text_tokens"]
