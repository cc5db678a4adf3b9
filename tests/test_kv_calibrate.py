"""Error-budget calibration and the format planner: the measurements mean what they say, the
planner is optimal, and a calibrated plan keeps its KL budget on held-out text."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kv import KVCachePlan
from jaxinfer import calibration as C
from jaxinfer.kv.layer_cache import one_shot_round_trip
from tiny_models import random_tokens, tiny_model

# ---- the planner ---------------------------------------------------------------------------------


def brute_force(kl, sizes, budget, allowed):
    best = None
    for choice in itertools.product(range(kl.shape[1]), repeat=kl.shape[0]):
        if not all(allowed[l, c] for l, c in enumerate(choice)):
            continue
        cost = sum(kl[l, c] for l, c in enumerate(choice))
        size = sum(sizes[c] for c in choice)
        if cost <= budget and (best is None or (size, cost) < best[:2]):
            best = (size, cost, choice)
    return best


def test_planner_spends_the_fewest_bytes_within_the_budget():
    """Against exhaustive search on random instances (4 layers x 4 formats, 256 plans each)."""
    rng = np.random.default_rng(0)
    sizes = np.array([1536, 396, 252, 156])  # like f32, int8, int4, int2
    for trial in range(40):
        kl = np.concatenate([np.zeros((4, 1)), np.sort(rng.exponential(0.01, (4, 3)), axis=1)], axis=1)
        allowed = rng.random((4, 4)) < 0.8
        allowed[:, 0] = True
        budget = float(rng.uniform(0, 0.05))
        size, cost, _ = brute_force(kl, sizes, budget, allowed)
        choice = C.choose_formats(kl, sizes, budget, allowed)
        assert sizes[choice].sum() == size, trial
        assert kl[np.arange(4), choice].sum() <= budget + 1e-12
        assert all(allowed[np.arange(4), choice])
    with pytest.raises(ValueError, match="no plan fits"):
        C.choose_formats(np.ones((2, 2)), np.array([2, 1]), 0.5)


def fake_calibration(formats=("f32", "int8", "int4"), layers=3) -> C.KVCalibration:
    """A calibration with made-up errors (planner tests need no model)."""
    n_f = len(formats)
    out_err = np.tile(np.array([0.0, 0.02, 0.1])[None, None, :n_f], (layers, 2, 1))
    out_err[1, 1, 1] = 0.05  # layer 1's second head is sensitive in int8
    kl = np.tile(np.array([0.0, 0.001, 0.01])[None, :n_f], (layers, 1))
    kl[2, 2] = 0.012  # layer 2 suffers most from int4
    return C.KVCalibration(formats=formats, reference="f32", page_size=16, n_tokens=0,
                           bytes_per_token=np.array([1536.0, 396.0, 252.0])[:n_f], score_err=3 * out_err, value_err=out_err / 2,
                           out_err=out_err, kl_uniform=kl.sum(0), kl_layer=kl, probe=None)


def test_plans_for_kl_and_output_error_budgets():
    calib = fake_calibration()
    assert C.plan_kv_cache(calib, budget_kl=0.0215).formats == ("int4", "int4", "int8")
    assert C.plan_kv_cache(calib, budget_kl=0.0).formats == ("f32",) * 3
    assert C.plan_kv_cache(calib, budget_kl=1.0).formats == ("int4",) * 3
    # max over heads of the relative output error <= 0.03: int8 everywhere except layer 1 (0.05)
    assert C.plan_kv_cache(calib, budget_out_err=0.03).formats == ("int8", "f32", "int8")
    both = C.plan_kv_cache(calib, budget_kl=0.0115, budget_out_err=0.03)
    assert both.formats == ("int8", "f32", "int8") and both.budget_out_err == 0.03
    for bad in (dict(), dict(budget_kl=-1.0), dict(budget_kl=float("nan")), dict(budget_out_err="0.1")):
        with pytest.raises(ValueError, match="budget"):
            C.plan_kv_cache(calib, **bad)


# ---- the measurements (tiny random model) ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_calibration():
    config, params = tiny_model(head_dim=16)
    tokens = random_tokens((2, 48), config.vocab_size, seed=7)
    calib = C.calibrate_kv(params, config, tokens, formats=("f32", "int8", "int4"), page_size=8, probe="int4")
    return config, params, tokens, calib


def test_score_and_value_errors_are_what_they_claim(tiny_calibration):
    """Recompute layer 1's errors in numpy from the captured q, k, v and the format's round trip:
    score error = RMS over visible (query, key) pairs of scale * q . (k' - k); value error =
    ||P (v' - v)|| / ||P v||; output error = ||attn(k', v') - attn(k, v)|| / ||attn(k, v)||."""
    config, params, tokens, calib = tiny_calibration
    q, k, v, _, _ = C.capture_attention_inputs(params, config, jnp.asarray(tokens), 8)
    q, k, v = (np.asarray(a[1], np.float64) for a in (q, k, v))  # layer 1
    n, t, hq, d = q.shape
    g = hq // config.n_kv_heads
    scale = 1 / math.sqrt(d)
    causal = np.tril(np.ones((t, t), bool))

    def attend(kk, vv, h):
        s = np.einsum("ntgd,nsd->ngts", q[:, :, h * g : (h + 1) * g], kk[:, :, h]) * scale
        p = np.exp(np.where(causal, s - s.max(-1, keepdims=True), -np.inf))
        p /= p.sum(-1, keepdims=True)
        return s, p, np.einsum("ngts,nsd->ngtd", p, vv[:, :, h])

    assert not calib.out_err[..., 0].any() and not calib.kl_layer[:, 0].any()  # f32 is exact
    for fi, name in enumerate(calib.formats):
        trip = jax.jit(one_shot_round_trip, static_argnums=(0, 3))(name, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), 8)
        kq, vq = (np.asarray(a, np.float64) for a in trip)
        for h in range(config.n_kv_heads):
            s, p, out = attend(k, v, h)
            sq, _, _ = attend(kq, v, h)
            score = np.sqrt(np.mean((sq - s)[:, :, causal] ** 2))
            value = np.linalg.norm(np.einsum("ngts,nsd->ngtd", p, vq[:, :, h] - v[:, :, h])) / np.linalg.norm(out)
            both = np.linalg.norm(attend(kq, vq, h)[2] - out) / np.linalg.norm(out)
            np.testing.assert_allclose(calib.score_err[1, h, fi], score, rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose(calib.value_err[1, h, fi], value, rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose(calib.out_err[1, h, fi], both, rtol=1e-4, atol=1e-7)
    assert (calib.out_err[..., 2] > calib.out_err[..., 1]).all()  # int4 is worse than int8 everywhere


def test_probe_cache_kl_equals_the_real_formats_kl(tiny_calibration):
    """The batched calibration cache (one program, a plan per row) gives the same end-to-end KL
    as prefilling through the real quantized caches."""
    config, params, tokens, calib = tiny_calibration
    plans = [("int8", "int4"), ("int4", "int4")]
    probe = C.measure_plans(params, config, tokens, plans, page_size=8)
    real = [C.evaluate_kv_cache(params, config, tokens, KVCachePlan(formats=p), page_size=8)["kl"] for p in plans]
    np.testing.assert_allclose(probe, real, rtol=1e-4)
    np.testing.assert_allclose(calib.kl_uniform[2], real[1], rtol=1e-4)
    # with the probe, layer l's int4 estimate is the measured KL of "only layer l in int4"
    only_layer_1 = C.measure_plans(params, config, tokens, [("f32", "int4")], page_size=8)[0]
    np.testing.assert_allclose(calib.kl_layer[1, 2], only_layer_1, rtol=1e-4)


def test_plan_within_budget_verifies_end_to_end(tiny_calibration):
    """Even when the per-layer estimates are 10x too optimistic, the measured KL of the
    returned plan is within margin * budget: the plan is checked end to end and tightened."""
    config, params, tokens, calib = tiny_calibration
    budget = 0.5 * calib.kl_uniform[2]  # all-int4 does not fit; something in between must
    optimistic = dataclasses.replace(calib, kl_layer=calib.kl_layer / 10)
    assert C.plan_kv_cache(optimistic, budget_kl=0.8 * budget).formats == ("int4", "int4")  # would overshoot
    plan = C.plan_within_budget(params, config, tokens, optimistic, budget_kl=budget, margin=0.8)
    measured = C.evaluate_kv_cache(params, config, tokens, plan, page_size=8)["kl"]
    assert plan.formats != ("f32", "f32") and plan.formats != ("int4", "int4")
    assert measured <= 0.8 * budget and abs(measured - plan.calibration_kl) <= 1e-4 * budget


def test_plan_within_budget_takes_an_output_error_budget_and_warns_when_nothing_fits(tiny_calibration, caplog):
    """An output-error budget alone: the cheapest plan within it, its KL measured. A KL budget
    below every quantized plan's: the full-precision plan (KL 0); one the tightening rounds
    do not reach: that plan too, with a warning that says so."""
    config, params, tokens, calib = tiny_calibration
    out_err = float(calib.out_err[..., 1].max())  # int8 fits every layer
    plan = C.plan_within_budget(params, config, tokens, calib, budget_kl=None, budget_out_err=out_err)
    assert plan.formats == C.plan_kv_cache(calib, budget_out_err=out_err).formats and "f32" not in plan.formats
    assert plan.calibration_kl == pytest.approx(C.evaluate_kv_cache(params, config, tokens, plan, page_size=8)["kl"], rel=1e-4)
    assert C.plan_within_budget(params, config, tokens, calib, budget_kl=1e-12).formats == ("f32", "f32")  # exact
    # estimates 10x too optimistic and one round to tighten in: no measured plan fits
    optimistic, budget = dataclasses.replace(calib, kl_layer=calib.kl_layer / 10), 0.5 * calib.kl_uniform[2]
    with caplog.at_level("WARNING", logger="jaxinfer.calibration.planner"):
        full = C.plan_within_budget(params, config, tokens, optimistic, budget_kl=budget, rounds=1)
    assert full.formats == ("f32", "f32") and f"no KV-cache plan met budget_kl={budget:g}" in caplog.text
    for bad, named in [(dict(budget_kl=-1.0), "budget_kl=-1.0"), (dict(budget_kl=None), "give a budget"),
                       (dict(budget_kl=0.1, margin=0.0), "margin=0.0")]:
        with pytest.raises(ValueError, match=named):
            C.plan_within_budget(params, config, tokens, calib, **bad)


# ---- the real model: a plan keeps its budget on held-out text -----------------------------------


@pytest.mark.extended
@pytest.mark.slow
def test_cli_plan_respects_its_kl_budget_on_held_out_text(smollm2_gguf, tmp_path, capsys, monkeypatch):
    """`jaxinfer calibrate-kv` (default model) on 256 calibration tokens; the plan's KL measured
    through the real quantized caches on 512 other tokens stays within the budget."""
    import jaxinfer.loading
    from jaxinfer.cli import main

    load_model = functools.lru_cache(jaxinfer.loading.load_model)  # the CLI and the test share one load
    monkeypatch.setattr(jaxinfer.loading, "load_model", load_model)
    budget, out = 0.01, tmp_path / "plan.json"
    assert main(["calibrate-kv", "--budget-kl", str(budget), "--out", str(out), "--tokens", "256", "--seq-len", "256",
                 "--formats", "f32,int8,int4", "--probe", "none"]) == 0
    assert "bytes/token" in capsys.readouterr().err
    plan = KVCachePlan.load(out)
    model = load_model(None, dtype="float32")
    assert len(plan.formats) == model.config.n_layers and plan.budget_kl == budget
    held_out = C.text_tokens(model.tokenizer, 2, 256, start=60_000)
    result = C.evaluate_kv_cache(model.params, model.config, held_out, plan)
    c = model.config
    ratio = plan.bytes_per_token(c.n_kv_heads, c.head_dim, 16) / (c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2)
    print(f"plan {plan.formats}: held-out KL {result['kl']:.5f} (calibration {plan.calibration_kl:.5f}), bytes vs bf16 {ratio:.3f}")
    assert result["kl"] <= budget
    assert ratio < 0.52  # cheaper than int8 everywhere (396 / 768 = 0.516): the budget was spent


def test_cli_rejects_bad_budgets_and_formats_before_loading(capsys):
    from jaxinfer.cli import main

    assert main(["calibrate-kv", "--out", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "--budget-kl" in err and "loading" not in err
    assert main(["calibrate-kv", "--budget-kl", "0.1", "--out", "x.json", "--formats", "int8,int5"]) == 2
    err = capsys.readouterr().err
    assert "'int5'" in err and "loading" not in err
    for bad, named in [(["--budget-kl", "-1"], "budget_kl=-1.0"), (["--budget-kl", "0.1", "--margin", "2"], "margin=2.0")]:
        assert main(["calibrate-kv", *bad, "--out", "x.json"]) == 2
        err = capsys.readouterr().err
        assert named in err and "loading" not in err, err
