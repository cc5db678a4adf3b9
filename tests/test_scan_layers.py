"""The stacked layer layout: `lax.scan` over runs of alike layers equals the unrolled forward.

Scanned and unrolled forwards must give the same greedy tokens and logits within 1e-6 (f32)
over a prefill and several decode steps, for every cache variant; the program must not grow
with depth; and the scan must write each layer's pages in place in the stacked pool.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_variants import mla_tiny_config
from tiny_models import tiny_config, tiny_model

from jaxinfer import layer_stack
from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.kv import KVCacheSpec, block_table_array, init_paged_kv
from jaxinfer.kv.plan import KVCachePlan
from jaxinfer.kv.streaming import StreamingSpec
from jaxinfer.loading import Model
from jaxinfer.model import forward, init_random_params
from jaxinfer.model import stacking
from jaxinfer.model import row_layouts
from jaxinfer.model.layers import DEFAULT_READS, PANEL_MAX_ROWS, READS, LinearLayouts, linear, linears, panel_width, to_panels
from jaxinfer.model.params import with_gemm_weights, without_gemm_weights
from jaxinfer.model.stacking import layer_runs, resolve_layer_loop, resolve_weight_layouts, with_layer_runs
from jaxinfer.sampling import SamplingParams

PLAN = KVCachePlan(("int8", "int8", "int4", "f32", "f32"))
CASES = {  # config, forward options
    "gqa": (tiny_config(n_layers=5), {}),
    "window": (tiny_config(n_layers=5, layer_windows=(None, 3, 3, None, 5)), {}),
    "sink_ring": (tiny_config(n_layers=5), {"streaming": StreamingSpec(num_sinks=2, window=5)}),
    "mla": (mla_tiny_config().replace(n_layers=3), {}),
    "plan": (tiny_config(n_layers=5), {"kv_cache": PLAN}),
    "int8": (tiny_config(n_layers=5), {"kv_cache": "int8"}),
}


def decode(params, config, kv, steps: int = 4) -> tuple[list[jax.Array], list[int]]:
    """Prefill two rows of different lengths, then decode greedily -> (logits per call, tokens)."""
    spec_pages = kv.max_pages_per_seq
    kv = kv.replace(block_tables=jnp.asarray(block_table_array(
        [list(range(1, 1 + spec_pages)), list(range(1 + spec_pages, 1 + 2 * spec_pages))], spec_pages)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    logits, kv = forward(params, config, tokens, positions, kv, num_new=jnp.array([6, 4], jnp.int32),
                         logits_index=jnp.array([5, 3], jnp.int32))
    out, greedy = [logits], []
    for _ in range(steps):
        nxt = jnp.argmax(out[-1], axis=-1).astype(jnp.int32)  # i32[2]
        greedy.append(nxt.tolist())
        logits, kv = forward(params, config, nxt[:, None], kv.lengths[:, None], kv)
        out.append(logits[:, 0])
    return out, greedy


def both_ways(config, streaming=None, kv_cache="auto"):
    params = init_random_params(config, seed=1, scale=0.3)
    spec = KVCacheSpec(num_pages=2 * 4 + 1, page_size=4, max_slots=2, max_pages_per_seq=4)
    unrolled = decode(params, config, init_paged_kv(config, spec, streaming=streaming, kv_cache=kv_cache))
    runs = layer_runs(config, kv_cache)
    kv = init_paged_kv(config, spec, streaming=streaming, kv_cache=kv_cache, layer_runs=runs)
    assert layer_stack.run_lengths(kv.layers) == runs
    return unrolled, decode(with_layer_runs(params, runs), config, kv), runs


@pytest.mark.parametrize("case", CASES)
def test_scanned_forward_equals_unrolled(case):
    config, options = CASES[case]
    (ref_logits, ref_tokens), (logits, tokens), runs = both_ways(config, **options)
    assert tokens == ref_tokens
    for want, got in zip(ref_logits, logits):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    if case in ("gqa", "int8", "sink_ring", "mla"):
        assert runs == (config.n_layers,)  # alike layers: one scan over all of them


def test_runs_follow_formats_windows_and_splits():
    assert layer_runs(tiny_config(n_layers=5), PLAN) == (2, 1, 2)
    assert layer_runs(tiny_config(n_layers=5, layer_windows=(None, 3, 3, None, 5))) == (1, 2, 1, 1)
    assert layer_runs(tiny_config(n_layers=5), "int8", split_at=(2,)) == (2, 3)


def test_layout_helpers_round_trip_and_keep_aligned_runs():
    config, params = tiny_model(n_layers=4)
    stacked = layer_stack.stack(params.layers, (3, 1))
    assert layer_stack.run_lengths(stacked) == (3, 1) and layer_stack.num_layers(stacked) == 4
    for a, b in zip(jax.tree.leaves(layer_stack.unstack(stacked)), jax.tree.leaves(params.layers)):
        np.testing.assert_array_equal(a, b)
    head = layer_stack.slice_layers(stacked, 0, 3)
    assert head[0] is stacked[0]  # a whole run: the same arrays, no copy
    cut = layer_stack.slice_layers(stacked, 1, 4)
    assert layer_stack.run_lengths(cut) == (2, 1)
    np.testing.assert_array_equal(cut[0].stacked.wq[0], params.layers[1].wq)
    with pytest.raises(ValueError, match="do not cover"):
        layer_stack.stack(params.layers, (3,))


def test_mismatched_layouts_and_runs_across_windows_raise():
    config = tiny_config(n_layers=2, layer_windows=(None, 3))
    params = init_random_params(config)
    spec = KVCacheSpec.for_batch(1, 8, page_size=4)
    tokens = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="layer layout"):
        forward(with_layer_runs(params, (1, 1)), config, tokens, tokens, init_paged_kv(config, spec))
    with pytest.raises(ValueError, match="attention window"):
        forward(with_layer_runs(params, (2,)), config, tokens, tokens, init_paged_kv(config, spec, layer_runs=(2,)))


def _lowered(n_layers: int, runs: bool):
    config = tiny_config(n_layers=n_layers)
    spec = KVCacheSpec(num_pages=13, page_size=4, max_slots=2, max_pages_per_seq=6)
    params = init_random_params(config)
    r = (n_layers,) if runs else None
    kv = init_paged_kv(config, spec, layer_runs=r)
    tokens = jnp.zeros((2, 1), jnp.int32)
    return forward.lower(with_layer_runs(params, r), config, tokens, tokens, kv)


def test_scanned_program_does_not_grow_with_depth():
    size = {(n, s): len(_lowered(n, s).as_text()) for n in (2, 8) for s in (False, True)}
    assert size[8, True] < 1.05 * size[2, True]
    assert size[8, False] > 3 * size[2, False]  # the unrolled program does


def test_scan_writes_pages_in_place():
    """No layer's pages are sliced out of the stacked pool, copied or put back: the scatter goes
    straight into the pool carried by the loop (`LayerCache.layer` views)."""
    hlo = _lowered(6, True).compile().as_text()
    pool = r"f32\[(1,)?13,4,2,8\]"  # one layer's k or v pages, [num_pages, page_size, Hkv, Dh]
    moves = [line for line in hlo.splitlines()
             if re.search(pool + r"\{[^}]*\} (dynamic-slice|dynamic-update-slice|copy)\(", line)]
    assert not moves, moves[:3]
    assert "while" in hlo


def test_layer_loop_option():
    assert resolve_layer_loop("auto", "cpu") == "unroll"
    assert resolve_layer_loop("auto", "gpu") == resolve_layer_loop("auto", "tpu") == "scan"
    with pytest.raises(ValueError, match="layer_loop"):
        EngineConfig(layer_loop="vmap")


@pytest.mark.parametrize("options", [pytest.param({}, id="plain"), pytest.param({"kv_cache": PLAN}, id="plan"),
                                     pytest.param({"speculative": SpeculativeConfig("self", 3, self_layers=2)},
                                                  id="self_speculation", marks=pytest.mark.extended)])
def test_engine_scan_equals_unroll(options):
    config, params = tiny_model(n_layers=5)
    model = Model(config, params, None)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5]]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = {}
    for loop in ("unroll", "scan"):
        engine = Engine(model, EngineConfig(max_slots=2, page_size=4, max_model_len=32, prefill_chunk=4,
                                            layer_loop=loop, **options))
        out[loop] = [o.token_ids for o in engine.generate(prompts, sp)]
        stacked = layer_stack.is_stacked(engine.model.params.layers)
        assert stacked == (loop == "scan") and layer_stack.is_stacked(engine.kv.layers) == stacked
    assert out["scan"] == out["unroll"]
    assert not layer_stack.is_stacked(model.params.layers)  # the caller's model is left as it was


def test_build_params_stacks_runs_and_orbax_stores_per_layer(tmp_path):
    from jaxinfer.checkpoint.orbax_io import load_orbax, save_orbax

    config = tiny_config(n_layers=4)
    unrolled = init_random_params(config, seed=3)
    stacked = init_random_params(config, seed=3, layer_runs=(1, 3))
    assert layer_stack.run_lengths(stacked.layers) == (1, 3)
    for a, b in zip(jax.tree.leaves(with_layer_runs(stacked, None)), jax.tree.leaves(unrolled)):
        np.testing.assert_array_equal(a, b)
    save_orbax(config, stacked, tmp_path / "ckpt")
    _, restored = load_orbax(tmp_path / "ckpt")
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(unrolled)):
        np.testing.assert_array_equal(a, b)


def test_stacked_shardings_keep_the_layer_axis_whole():
    from jax.sharding import PartitionSpec as P

    from jaxinfer import sharding

    config = tiny_config(n_layers=3)
    mesh = sharding.make_mesh("data=1,model=1")
    shardings = sharding.param_shardings(init_random_params(config, layer_runs=(3,)), config, mesh)
    assert shardings.layers[0].stacked.wq.spec == P(None, "model", None)
    kv = init_paged_kv(config, KVCacheSpec.for_batch(1, 8, page_size=4), kv_cache="int8", layer_runs=(3,))
    kv_sh = sharding.kv_shardings(kv, mesh)
    assert kv_sh.layers[0].stacked.k_scale.spec == P(None, "data", None, "model")


# Weight layouts (`EngineConfig.weight_layouts`): the dense layers' weights also stored as
# column panels and transposed, which multi-row products read (`jaxinfer.model.layers.LinearLayouts`).

ALL_READS = list(itertools.product(*READS))


@pytest.mark.parametrize("case", ["gqa", "window", "mla", "plan"])
@pytest.mark.parametrize("stacked", [False, True])
def test_all_weight_layouts_forward_equals_one(case, stacked):
    """Prefill rows (GEMMs over `kn` or batched matmuls over `panels`), two decode rows (the same) and one
    decode row (gemvs over `nk`, or over `kn` and the q/k/v and gate/up groups with ("kn", "kn") reads) give
    the one-layout forward's logits to f32 rounding (different kernels, so not bit for bit)."""
    config, options = CASES[case]
    params = init_random_params(config, seed=1, scale=0.3)
    spec = KVCacheSpec(num_pages=2 * 4 + 1, page_size=4, max_slots=2, max_pages_per_seq=4)
    runs = layer_runs(config, options.get("kv_cache", "auto")) if stacked else None
    params = with_layer_runs(params, runs)
    fresh = lambda: init_paged_kv(config, spec, layer_runs=runs, **options)
    ref_logits, ref_tokens = decode(params, config, fresh())
    every = with_gemm_weights(params)
    if config.mla is None:
        assert sum(isinstance(x, LinearLayouts) for x in jax.tree.leaves(
            every.layers, is_leaf=lambda x: isinstance(x, LinearLayouts))) == len(every.layers) * 7
    one_spec = KVCacheSpec(num_pages=4 + 1, page_size=4, max_slots=1, max_pages_per_seq=4)
    one_row = lambda p: decode_one_row(p, config, init_paged_kv(config, one_spec, layer_runs=runs, **options))
    ref_one = one_row(params)
    for reads in (DEFAULT_READS, ("kn", "kn")):
        logits, tokens = decode(with_gemm_weights(every, reads), config, fresh())
        assert tokens == ref_tokens
        for want, got in zip(ref_logits + ref_one, logits + one_row(with_gemm_weights(every, reads))):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def decode_one_row(params, config, kv, steps: int = 3) -> list[jax.Array]:
    """One sequence: a 5-token prefill, then `steps` one-token steps -> logits per call."""
    kv = kv.replace(block_tables=jnp.asarray(block_table_array([list(range(1, 1 + kv.max_pages_per_seq))],
                                                               kv.max_pages_per_seq)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (1, 5)), jnp.int32)
    logits, kv = forward(params, config, tokens, jnp.arange(5, dtype=jnp.int32)[None], kv,
                         logits_index=jnp.array([4], jnp.int32))
    out = [logits]
    for _ in range(steps):
        nxt = jnp.argmax(out[-1], axis=-1).astype(jnp.int32)[:, None]  # i32[1, 1]
        logits, kv = forward(params, config, nxt, kv.lengths[:, None], kv)
        out.append(logits[:, 0])
    return out


@pytest.mark.parametrize("rows", [(1,), (1, 1), (2,), (PANEL_MAX_ROWS,), (2, 3), (PANEL_MAX_ROWS + 1,)])
@pytest.mark.parametrize("biases", [None, (True, True, True), (False, True, False)])
def test_linear_forms_agree(rows, biases):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((*rows, 24)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((n, 24)), jnp.float32) for n in (64, 16, 8)]
    bs = None if biases is None else tuple(jnp.asarray(rng.standard_normal(w.shape[0]), jnp.float32) if on else None
                                           for w, on in zip(ws, biases))
    want = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + (0 if b is None else np.asarray(b, np.float64))
            for w, b in zip(ws, bs or (None,) * 3)]
    layouts = [[LinearLayouts.of(w, reads) for w in ws] for reads in ALL_READS]
    kn = [LinearLayouts.of(w, ("kn", "kn")) for w in ws]
    grouped = [dataclasses.replace(kn[0], group=jnp.concatenate([w.kn for w in kn], axis=-1))] + kn[1:]
    for got in ([[linear(x, w, b) for w, b in zip(ws, bs or (None,) * 3)], linears(x, tuple(ws), bs)]
                + [[linear(x, w, b) for w, b in zip(lw, bs or (None,) * 3)] for lw in layouts]
                + [linears(x, tuple(lw), bs) for lw in layouts + [grouped]]
                # a group that is not these weights' is not read
                + [linears(x, tuple(grouped[:2]), bs and bs[:2]) + [linear(x, ws[2], bs and bs[2])]]):
        for g, w in zip(got, want):
            assert g.shape == (*rows, w.shape[-1])
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [8, 48, 64, 192])
def test_panels_hold_the_weight(n):
    """`to_panels` cuts [.., N, K] into [.., N // P, K, P] column panels with the widest P that divides N."""
    w = np.arange(3 * n * 5, dtype=np.float32).reshape(3, n, 5)  # a stacked [L, N, K] weight
    p = panel_width(n)
    assert p == {8: 8, 48: 16, 64: 64, 192: 64}[n]
    panels = np.asarray(to_panels(jnp.asarray(w)))
    assert panels.shape == (3, n // p, 5, p)
    for j, c in [(0, 0), (n // p - 1, p - 1), (n // p // 2, p // 2)]:
        np.testing.assert_array_equal(panels[:, j, :, c], w[:, j * p + c, :])
    with pytest.raises(ValueError, match="panel width"):
        to_panels(jnp.zeros((12, 5)))


@pytest.mark.parametrize("tied", [True, False])
def test_engine_params_save_as_the_checkpoint(tmp_path, tied):
    """An engine's params in all layouts (a tied LM head too) save as the plain checkpoint."""
    from jaxinfer.checkpoint import load_orbax, save_orbax

    config, params = tiny_model(n_layers=2, tie_embeddings=tied)
    assert (params.lm_head is None) == tied
    eng = Engine(Model(config=config, params=params, tokenizer=None), EngineConfig(max_slots=1, max_model_len=16,
                                                                                   weight_layouts="all"))
    assert isinstance(eng.model.params.lm_head, LinearLayouts)
    plain = without_gemm_weights(eng.model.params)
    assert jax.tree.structure(plain) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(plain), jax.tree.leaves(params)):
        assert got is want
    save_orbax(config, eng.model.params, tmp_path / "m")
    _, loaded = load_orbax(tmp_path / "m")
    assert (loaded.lm_head is None) == tied
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_weight_layouts_option(monkeypatch):
    config, params = tiny_model(n_layers=2)
    assert resolve_weight_layouts("auto", params, backend="cpu") == "all"
    assert resolve_weight_layouts("auto", params, backend="gpu") == resolve_weight_layouts("auto", params, backend="tpu") == "one"
    assert resolve_weight_layouts("auto", params, mesh=object(), backend="cpu") == "one"
    assert resolve_weight_layouts("one", params, backend="cpu") == "one"
    monkeypatch.setattr(stacking, "AUTO_COPIES_LIMIT", 1000)  # the tiny layers' weight copies exceed it
    assert resolve_weight_layouts("auto", params, backend="cpu") == "one"
    with pytest.raises(ValueError, match="weight_layouts"):
        resolve_weight_layouts("transposed", params)
    with pytest.raises(ValueError, match="weight_layouts"):
        EngineConfig(weight_layouts="transposed")


def test_engine_weight_layouts_generate_the_same():
    config, params = tiny_model(n_layers=2)
    model = Model(config=config, params=params, tokenizer=None)
    prompts = [[3, 5, 7, 11, 13], [17, 19, 23]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for layouts, reads in (("one", "auto"), ("all", "auto"), ("all", ("kn", "kn"))):
        eng = Engine(model, EngineConfig(max_slots=2, max_model_len=32, prefill_chunk=4, weight_layouts=layouts,
                                         row_layouts=reads, speculative=SpeculativeConfig("ngram", 2)))
        stored = [x for x in jax.tree.leaves(eng.model.params, is_leaf=lambda x: isinstance(x, LinearLayouts))
                  if isinstance(x, LinearLayouts)]
        assert bool(stored) == (layouts == "all")
        # a tiny model is not worth timing: "auto" keeps the default
        assert eng.row_layouts == (None if layouts == "one" else DEFAULT_READS if reads == "auto" else reads)
        assert all(w.reads == eng.row_layouts for w in stored)
        # one row reading `kn` reads q/k/v and gate/up each in one gemv over a stored group
        layer = eng.model.params.layers[0]
        for first, names in ((getattr(layer, "wq", None), ("wq", "wk", "wv")), (getattr(layer, "w_gate", None), ("w_gate", "w_up"))):
            if isinstance(first, LinearLayouts):
                want = None if first.reads[0] == "nk" else np.concatenate([getattr(layer, n).kn for n in names], axis=-1)
                assert (first.group is None) if want is None else np.array_equal(first.group, want)
        outs[layouts, reads] = [o.token_ids for o in eng.generate(prompts, sp)]
    assert len(set(map(str, outs.values()))) == 1, outs


@pytest.mark.parametrize("bad", [("kn",), ("panels", "kn"), ("nk", "nk"), ["kn", "kn"], "kn"])
def test_row_layouts_option_names_what_each_row_count_reads(bad):
    with pytest.raises(ValueError, match="row_layouts.*one row reads one of"):
        EngineConfig(row_layouts=bad)
    with pytest.raises(ValueError, match="one row reads one of"):
        LinearLayouts.of(jnp.zeros((8, 4)), bad)
    with pytest.raises(ValueError, match="only weight_layouts 'all'"):
        EngineConfig(weight_layouts="one", row_layouts=("kn", "kn"))


def test_pick_reads_keeps_the_default_unless_another_is_clearly_faster():
    few = row_layouts.FEW_ROWS
    ms = {(1, "nk"): 10.0, (1, "kn"): 9.6, (few, "panels"): 20.0, (few, "kn"): 18.0}
    assert row_layouts.pick_reads(ms) == ("nk", "kn")  # 4 % faster is noise, 10 % is not
    ms[1, "kn"], ms[few, "kn"] = 9.0, 25.0
    assert row_layouts.pick_reads(ms) == ("kn", "panels")


def test_row_layouts_measured_once_per_machine(tmp_path, monkeypatch):
    """"auto" measures a model worth measuring on the model's own weights, remembers the answer in
    $JAXINFER_CACHE/row_layouts.json, and a later process reads it back instead of measuring again
    (a damaged entry is measured again)."""
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(row_layouts, "_CHOSEN", {})
    config, params = tiny_model(n_layers=2)
    every = with_gemm_weights(params)
    assert row_layouts.choose_reads(every) == DEFAULT_READS  # under MEASURE_MIN_BYTES: no timing
    assert not (tmp_path / "row_layouts.json").exists()
    assert row_layouts.choose_reads(every, ("kn", "kn")) == ("kn", "kn")

    monkeypatch.setattr(row_layouts, "MEASURE_MIN_BYTES", 0)
    stacked = with_gemm_weights(with_layer_runs(params, layer_runs(config)))  # a scanned run's layers, one by one
    for p in (every, stacked):
        measured = row_layouts.measure_reads(p, rounds=1)
        assert set(measured["ms"]) == {(1, "nk"), (1, "kn"), (row_layouts.FEW_ROWS, "panels"), (row_layouts.FEW_ROWS, "kn")}
        assert all(t > 0 for t in measured["ms"].values())
    assert len(row_layouts._chain_weights(stacked)) == len(row_layouts._chain_weights(every)) == 2 * 7 + 1
    chosen = row_layouts.choose_reads(every)
    assert chosen in ALL_READS
    saved = json.loads((tmp_path / "row_layouts.json").read_text())
    assert list(saved.values()) == [list(chosen)]

    measured_again = []

    def counting(*_):
        measured_again.append(1)
        return {"reads": chosen, "ms": {}}

    monkeypatch.setattr(row_layouts, "_CHOSEN", {})  # a new process
    monkeypatch.setattr(row_layouts, "measure_reads", counting)
    assert row_layouts.choose_reads(every) == chosen and not measured_again
    (tmp_path / "row_layouts.json").write_text(json.dumps({k: ["nk", "bogus"] for k in saved}))
    monkeypatch.setattr(row_layouts, "_CHOSEN", {})
    assert row_layouts.choose_reads(every) == chosen and measured_again == [1]

    def failing(*_):
        raise RuntimeError("no compiler today")

    (tmp_path / "row_layouts.json").unlink()
    monkeypatch.setattr(row_layouts, "_CHOSEN", {})
    monkeypatch.setattr(row_layouts, "measure_reads", failing)
    assert row_layouts.choose_reads(every) == DEFAULT_READS  # a failed timing keeps the default, the engine starts
    # bf16 weights are never timed (XLA:CPU's bf16 few-row products took minutes): the default
    monkeypatch.setattr(row_layouts, "measure_reads", counting)
    bf16 = with_gemm_weights(jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params))
    assert row_layouts.choose_reads(bf16) == DEFAULT_READS and measured_again == [1]
