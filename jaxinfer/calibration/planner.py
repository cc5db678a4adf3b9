"""Plan per-layer KV-cache formats within an explicit error budget, from a calibration.

The planner picks the per-layer formats with the fewest bytes whose summed KL estimate fits the
budget (an exact multiple-choice knapsack over bytes), then `plan_within_budget` measures the
plan end to end (`jaxinfer.calibration.measure`) and tightens until the measured KL fits (with
a margin for unseen text). `calibrate_plan` is the whole procedure `jaxinfer calibrate-kv` runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from jaxinfer.calibration.measure import KVCalibration, calibrate_kv, measure_plans, text_tokens
from jaxinfer.config import ModelConfig
from jaxinfer.kv import formats as F
from jaxinfer.kv.plan import KVCachePlan
from jaxinfer.model.params import ModelParams

logger = logging.getLogger(__name__)

# ---- the planner ----------------------------------------------------------------------------


def choose_formats(kl: np.ndarray, sizes: np.ndarray, budget: float, allowed: np.ndarray | None = None) -> np.ndarray:
    """Exact multiple-choice knapsack: per row (layer) one column (format) -> i64[L] choices
    minimising sum(sizes[choice]) subject to sum(kl[l, choice[l]]) <= budget.

    kl: f64[L, F] (estimated cost of each choice), sizes: [F] positive integers,
    allowed: bool[L, F] (default all). Ties in bytes go to the smaller total KL.
    Raises ValueError when no allowed plan fits.
    """
    kl = np.asarray(kl, np.float64)
    sizes = np.asarray(sizes, np.int64)
    allowed = np.ones(kl.shape, bool) if allowed is None else np.asarray(allowed, bool)
    cost = np.where(allowed, kl, np.inf)
    unit = int(np.gcd.reduce(sizes))
    steps = sizes // unit
    n_layers, n_formats = cost.shape
    top = int(steps.max()) * n_layers
    best = np.full(top + 1, np.inf)  # best[b]: least KL of the layers so far at exactly b units
    best[0] = 0.0
    pick = np.zeros((n_layers, top + 1), np.int64)
    for layer in range(n_layers):
        new = np.full(top + 1, np.inf)
        for f in range(n_formats):
            s = steps[f]
            cand = np.full(top + 1, np.inf)
            cand[s:] = best[: top + 1 - s] + cost[layer, f]
            better = cand < new
            new[better], pick[layer, better] = cand[better], f
        best = new
    fits = np.flatnonzero(best <= budget * (1 + 1e-12))
    if fits.size == 0:
        raise ValueError(f"no plan fits the budget {budget:g} (the smallest reachable total is {best.min():g})")
    b = int(fits[0])
    choice = np.zeros(n_layers, np.int64)
    for layer in reversed(range(n_layers)):
        choice[layer] = pick[layer, b]
        b -= steps[choice[layer]]
    return choice


def check_budgets(budget_kl: float | None, budget_out_err: float | None, margin: float = 0.8) -> None:
    """ValueError naming the value unless at least one budget is given and each is a finite
    number >= 0 (and the margin in (0, 1])."""
    if budget_kl is None and budget_out_err is None:
        raise ValueError("give a budget: budget_kl and/or budget_out_err")
    for name, b in (("budget_kl", budget_kl), ("budget_out_err", budget_out_err)):
        if b is not None and not (isinstance(b, (int, float)) and not isinstance(b, bool) and b >= 0 and math.isfinite(b)):
            raise ValueError(f"{name}={b!r} must be a finite number >= 0")
    if not (isinstance(margin, (int, float)) and 0 < margin <= 1):
        raise ValueError(f"margin={margin!r} must be in (0, 1]")


def plan_kv_cache(calib: KVCalibration, budget_kl: float | None = None, budget_out_err: float | None = None,
                  model: str = "") -> KVCachePlan:
    """The fewest-bytes per-layer plan within the budget(s), from the calibration's estimates.

    `budget_kl`: the summed per-layer KL estimates stay <= it. `budget_out_err`: in every layer
    and KV head the relative attention-output error stays <= it. Either or both.
    """
    check_budgets(budget_kl, budget_out_err)
    allowed = np.ones(calib.kl_layer.shape, bool)
    if budget_out_err is not None:
        allowed = calib.out_err.max(axis=1) <= budget_out_err  # the reference's error is 0: always allowed
    kl = calib.kl_layer if budget_kl is not None else np.zeros_like(calib.kl_layer)
    sizes = np.rint(calib.bytes_per_token * calib.page_size).astype(np.int64)  # bytes per page: integers
    choice = choose_formats(kl, sizes, budget_kl if budget_kl is not None else 0.0, allowed)
    return KVCachePlan(formats=tuple(calib.formats[c] for c in choice), page_size=calib.page_size,
                       budget_kl=budget_kl, budget_out_err=budget_out_err, model=model)


def plan_within_budget(params: ModelParams, config: ModelConfig, tokens: np.ndarray, calib: KVCalibration,
                       budget_kl: float | None, budget_out_err: float | None = None, margin: float = 0.8,
                       rounds: int = 6, model: str = "") -> KVCachePlan:
    """Plan, measure the plan's KL end to end on tokens, and tighten until it is <= margin * budget.

    The margin leaves room for text the calibration did not see. The returned plan records
    the measured KL as `calibration_kl`; if nothing fits, the full-precision plan is returned
    (with a warning). With `budget_kl` None the plan is the cheapest within `budget_out_err`,
    its KL measured.
    """
    check_budgets(budget_kl, budget_out_err, margin)

    def measure(plan: KVCachePlan) -> float:
        return float(measure_plans(params, config, tokens, [plan.formats], calib.page_size, formats=calib.formats)[0])

    if budget_kl is None:
        plan = plan_kv_cache(calib, None, budget_out_err, model)
        return dataclasses.replace(plan, calibration_kl=measure(plan))
    target = margin * budget_kl
    estimate, least = target, math.inf
    for _ in range(rounds):
        plan = plan_kv_cache(calib, estimate, budget_out_err, model)
        kl = measure(plan)
        if kl <= target:
            return dataclasses.replace(plan, budget_kl=budget_kl, calibration_kl=kl)
        least = min(least, kl)
        estimate *= 0.9 * target / kl
    logger.warning("no KV-cache plan met budget_kl=%g (margin %g: KL <= %g); the closest measured %.3g, so the plan "
                   "keeps every layer in %s", budget_kl, margin, target, least, calib.reference)
    full = (calib.reference,) * config.n_layers
    return KVCachePlan(formats=full, page_size=calib.page_size, budget_kl=budget_kl,
                       budget_out_err=budget_out_err, calibration_kl=0.0, model=model)


# ---- the whole procedure (what `jaxinfer calibrate-kv` runs) --------------------------------------


def calibrate_plan(model, budget_kl: float | None = None, budget_out_err: float | None = None, n_tokens: int = 512,
                   seq_len: int = 256, page_size: int = 16, formats: tuple[str, ...] = F.FORMAT_NAMES,
                   probe: str | None = "int4", margin: float = 0.8, log=lambda msg: None) -> tuple[KVCachePlan, KVCalibration]:
    """Calibrate `model` (a `jaxinfer.loading.Model`) on `n_tokens` of `english_text()` and plan.

    With `budget_kl` the plan is verified end to end (`plan_within_budget`); with only
    `budget_out_err` it is the cheapest format per layer within that error.
    """
    check_budgets(budget_kl, budget_out_err, margin)  # before minutes of calibration
    if model.tokenizer is None:
        raise ValueError("calibration needs a model with a tokenizer (it reads English text)")
    if n_tokens < seq_len or seq_len <= 0:
        raise ValueError(f"n_tokens={n_tokens} must be >= seq_len={seq_len} > 0")
    tokens = text_tokens(model.tokenizer, n_tokens // seq_len, seq_len)
    log(f"calibrating on {tokens.size} tokens ({tokens.shape[0]} x {seq_len}), page_size={page_size}, "
        f"formats {', '.join(formats)}" + (f", per-layer KL probe {probe}" if probe else ""))
    calib = calibrate_kv(model.params, model.config, tokens, formats, page_size, probe)
    log(calib.table())
    name = model.source.rsplit("/", 1)[-1]
    plan = plan_within_budget(model.params, model.config, tokens, calib, budget_kl, budget_out_err, margin, model=name)
    return plan, calib
