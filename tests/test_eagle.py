"""EAGLE draft head: training's unrolled head is the head inference runs; exact speculation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.loading import Model
from jaxinfer.model import TokenGroup
from jaxinfer.sampling import SamplingParams
from jaxinfer.speculative import SpeculativeConfig
from jaxinfer.model import forward_hidden
from jaxinfer.model.stacking import layer_runs, with_layer_runs
from jaxinfer.speculative.eagle import bind_head, init_eagle_params, load_eagle_head, save_eagle_head
from jaxinfer.speculative.eagle.head import target_features
from jaxinfer.speculative.eagle.step import _head_forward
from jaxinfer.speculative.train.dense import dense_features, dense_streams
from jaxinfer.speculative.train.eagle import ttt_logits
from tiny_models import random_tokens, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> Model:
    config, params = tiny_model(max_position=512)
    return Model(config=config, params=params, tokenizer=None)


@pytest.fixture(scope="module")
def deep() -> Model:
    """Four layers: room for taps inside what would be one scanned run."""
    config, params = tiny_model(max_position=512, n_layers=4)
    return Model(config=config, params=params, tokenizer=None)


def random_head(model: Model, seed: int = 0, subset: bool = True, feature_layers: tuple[int, ...] = ()):
    """A head with random (not the init's near-identity) weights, so every part matters;
    `feature_layers`: an EAGLE-3 head fusing those layers' streams."""
    params = init_eagle_params(model, seed, feature_layers)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    params = jax.tree.unflatten(tree, [a + 0.3 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])
    ids = np.arange(0, model.config.vocab_size, 2) if subset else np.arange(model.config.vocab_size)
    return bind_head(model, params, ids)


@pytest.mark.parametrize("context,fused", [(1, False), pytest.param(5, False, marks=pytest.mark.extended), (12, False),
                                           (6, True)])
def test_training_unroll_matches_inference_drafting(model, context, fused):
    """ttt_logits step j at pair t == the head drafting j steps past a context of t - j + 1
    true pairs over its paged cache (the training-time test trains what inference runs);
    `fused`: an EAGLE-3 head over both layers' streams."""
    head = random_head(model, feature_layers=(0, 1) if fused else ())
    c, steps, t = model.config, 3, 20
    tokens = random_tokens((1, t), c.vocab_size, seed=context)
    if fused:  # training reads the streams; drafting, the feature the step fused from them
        streams = dense_streams(model.params, c, jnp.asarray(tokens), (0, 1))  # [1, T, 2, D]
        trained = ttt_logits(head.params, head.embed, head.lm_head, c, jnp.asarray(tokens), streams, steps)
        features = target_features(head.params, streams, c.rms_eps)
    else:
        features = dense_features(model.params, c, jnp.asarray(tokens))  # [1, T, D]
        trained = ttt_logits(head.params, head.embed, head.lm_head, c, jnp.asarray(tokens), features, steps)

    spec = KVCacheSpec.for_batch(1, 64, page_size=8)
    hkv = init_paged_kv(head.config, spec)
    hkv = hkv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32).reshape(1, -1))
    slots = jnp.zeros(1, jnp.int32)
    # the accepted context: pairs (f_i, x_{i+1}) for i < context, in one block
    group = TokenGroup(tokens=jnp.asarray(tokens[:, 1 : context + 1]), positions=jnp.arange(context)[None],
                       slots=slots, num_new=jnp.asarray([context]), logits_index=jnp.asarray([context - 1]))
    logits, hidden, hkv = _head_forward(head.params, head.embed, head.lm_head, head.config, hkv, group,
                                        features[:, :context], "reference")
    feature = hidden[:, -1:]
    for j in range(steps):
        pair = context - 1 + j
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(trained[j][0, pair]), rtol=1e-4, atol=1e-4)
        group = TokenGroup(tokens=jnp.asarray(tokens[:, pair + 2 : pair + 3]), positions=jnp.asarray([[pair + 1]]),
                           slots=slots, num_new=jnp.ones(1, jnp.int32), logits_index=jnp.zeros(1, jnp.int32))
        logits, feature, hkv = _head_forward(head.params, head.embed, head.lm_head, head.config, hkv, group, feature,
                                             "reference")


@pytest.mark.parametrize("loop", ["unroll", "scan"])
def test_tapped_streams_match_the_dense_forward(deep, loop):
    """forward_hidden's taps (serving, paged) == dense_streams (training), also when the
    layers run as scans cut at the taps; a tap inside a scanned run is refused."""
    c, taps = deep.config, (0, 2, 3)
    tokens = random_tokens((2, 9), c.vocab_size, seed=1)
    runs = layer_runs(c, split_at=(1, 3)) if loop == "scan" else None
    spec = KVCacheSpec.for_batch(2, 16, page_size=8)
    kv = init_paged_kv(c, spec, layer_runs=runs)
    kv = kv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32).reshape(2, -1))
    group = TokenGroup(tokens=jnp.asarray(tokens), positions=jnp.broadcast_to(jnp.arange(9), (2, 9)),
                       slots=jnp.arange(2, dtype=jnp.int32), num_new=jnp.full(2, 9, jnp.int32))
    params = with_layer_runs(deep.params, runs)
    _, (streams,), _ = forward_hidden(params, c, kv, (group,), taps=taps)
    expected = dense_streams(deep.params, c, jnp.asarray(tokens), taps)  # [2, 9, 3, D]
    np.testing.assert_allclose(np.asarray(streams), np.asarray(expected), rtol=1e-4, atol=1e-4)
    if loop == "scan":
        with pytest.raises(ValueError, match="inside the scanned run"):
            forward_hidden(params, c, kv, (group,), taps=(0, 1, 3))


def engine(model, speculative=None, **kw) -> Engine:
    return Engine(model, EngineConfig(**({"max_slots": 4, "page_size": 8, "prefill_chunk": 8, "max_model_len": 64,
                                          "speculative": speculative} | kw)))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = [rng.integers(0, 97, int(rng.integers(1, 40))).tolist() for _ in range(n)]
    shared = rng.integers(0, 97, 17).tolist()
    return out + [shared + [1, 2], shared + [3]]  # a shared prefix for the prefix cache


@pytest.mark.parametrize("settings", [pytest.param(dict(num_pages=9), id="preemption+prefix-cache"),
                                      pytest.param(dict(kv_cache="int8"), id="int8", marks=pytest.mark.extended),
                                      pytest.param(dict(layer_loop="scan"), id="scan", marks=pytest.mark.extended)])
def test_greedy_eagle_speculation_equals_plain_decoding(model, settings):
    plain = [o.token_ids for o in engine(model, **settings).generate(prompts(8), GREEDY)]
    eng = engine(model, SpeculativeConfig("eagle", 3, draft=random_head(model)), **settings)
    assert [o.token_ids for o in eng.generate(prompts(8), GREEDY)] == plain
    stats = eng.metrics().speculative
    assert stats.drafted.sum() > 0
    if "num_pages" in settings:
        assert eng.metrics().preemptions > 0


def test_eagle_compiles_nothing_after_warmup_and_honours_opt_out(model):
    eng = engine(model, SpeculativeConfig("eagle", 3, draft=random_head(model)), num_pages=9)
    eng.warmup()
    before = eng.metrics().obtained_programs
    rng = np.random.default_rng(3)
    ps = [rng.integers(0, 97, int(rng.integers(1, 34))).tolist() for _ in range(20)]
    sp = [SamplingParams(temperature=float(rng.choice([0.0, 1.0])), top_k=int(rng.integers(0, 5)),
                         max_tokens=int(rng.integers(1, 30)), ignore_eos=True, seed=i,
                         speculative=bool(i % 3)) for i in range(20)]
    outs = eng.generate(ps, sp)
    assert eng.metrics().obtained_programs == before
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, sp))
    opted_out = [o.metrics.speculative for o, p in zip(outs, sp) if not p.speculative]
    assert all(s is None or s.drafted.sum() == 0 for s in opted_out)


@pytest.mark.parametrize("loop", ["unroll", pytest.param("scan", marks=pytest.mark.extended)])
def test_greedy_fused_eagle_speculation_equals_plain_decoding(deep, loop):
    """An EAGLE-3 head (three tapped layers; scanned layers split at them) is exact too."""
    plain = [o.token_ids for o in engine(deep, layer_loop=loop).generate(prompts(6), GREEDY)]
    eng = engine(deep, SpeculativeConfig("eagle", 3, draft=random_head(deep, feature_layers=(0, 2, 3))), layer_loop=loop)
    assert [o.token_ids for o in eng.generate(prompts(6), GREEDY)] == plain
    assert eng.metrics().speculative.drafted.sum() > 0


def test_bad_eagle_heads_are_rejected(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="not an EAGLE head"):
        engine(model, SpeculativeConfig("eagle", 2, draft=tmp_path))
    other = Model(*tiny_model(seed=5, max_position=512, d_model=48, head_dim=12), None)
    with pytest.raises(ValueError, match="different target"):
        engine(model, SpeculativeConfig("eagle", 2, draft=random_head(other)))
    with pytest.raises(ValueError, match="feature_layers"):
        init_eagle_params(model, 0, (1, 0))
    fused = init_eagle_params(model, 0, (0, 1))
    with pytest.raises(ValueError, match="fusion weights"):
        bind_head(model, dataclasses.replace(fused, feature_layers=(1,)), np.arange(10))
    assert SpeculativeConfig.parse("eagle:/x", 3).draft == "/x"
    assert SpeculativeConfig.parse("self:6", 3).self_layers == 6
    for bad in ("self:abc", "self:-2", "ngram:3", "medusa"):
        with pytest.raises(ValueError, match=f"--speculative '{bad}': "):
            SpeculativeConfig.parse(bad)


# ---- the sampled distribution, end to end (helpers shared with test_speculative_engine) -------


def test_sampled_eagle_speculation_keeps_the_target_distribution():
    from test_speculative_engine import SETTINGS, VOCAB, chi_square_p, exact_first_three, first_three

    target = Model(*tiny_model(seed=3, vocab_size=VOCAB, max_position=64), None)
    head = random_head(target, seed=2, subset=False)
    for setting in ("temperature-1", "top-p-0.7"):
        expected, allowed = exact_first_three(target, SETTINGS[setting])
        cells = first_three(target, SETTINGS[setting], SpeculativeConfig("eagle", 3, draft=head))
        assert allowed[cells].all()
        assert chi_square_p(cells, expected) > 1e-3, setting


@pytest.mark.extended
def test_the_chi_square_check_catches_a_misreported_eagle_q(monkeypatch):
    """Power: a head that reports a q other than the one it sampled from is caught."""
    import jaxinfer.speculative.eagle.step as eagle_step
    from test_speculative_engine import SETTINGS, VOCAB, chi_square_p, exact_first_three, first_three

    target = Model(*tiny_model(seed=3, vocab_size=VOCAB, max_position=64), None)
    head = random_head(target, seed=2, subset=False)
    expected, _ = exact_first_three(target, SETTINGS["temperature-1"])
    honest = eagle_step.sample_draft
    monkeypatch.setattr(eagle_step, "sample_draft", lambda *a: (lambda i, q: (i, jnp.roll(q, 1, axis=-1)))(*honest(*a)))
    jax.clear_caches()
    try:
        cells = first_three(target, SETTINGS["temperature-1"], SpeculativeConfig("eagle", 3, draft=head))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert chi_square_p(cells, expected) < 1e-3


@pytest.mark.parametrize("feature_layers", [(), (0, 1)])
def test_an_eagle_head_round_trips_through_its_checkpoint(model, tmp_path, feature_layers):
    head = random_head(model, feature_layers=feature_layers)
    save_eagle_head(head.params, head.vocab_ids, model, tmp_path / "head", figures={"note": "test"})
    loaded = load_eagle_head(model, tmp_path / "head")
    np.testing.assert_array_equal(loaded.vocab_ids, head.vocab_ids)
    assert loaded.feature_layers == feature_layers
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(head.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b.astype(jnp.bfloat16).astype(a.dtype)))
    other = Model(dataclasses.replace(model.config, d_model=48), model.params, None)
    with pytest.raises(ValueError, match="d_model"):
        load_eagle_head(other, tmp_path / "head")


@pytest.mark.extended
@pytest.mark.parametrize("feature_layers", [(), "auto"])
def test_tiny_eagle_training_learns_and_saves(model, tmp_path, feature_layers):
    """End to end on a tiny target: generation, teacher features, training-time-test
    training (the loss falls), a checkpoint the engine loads and speculates with exactly;
    unfused and with EAGLE-3's fusion."""
    from jaxinfer.speculative.train.eagle import EagleTrainingConfig, train_eagle

    cfg = EagleTrainingConfig(vocab_subset=48, new_tokens=24, temperatures=(0.0, 1.0), top_k=8, epochs=6, lr=1e-2,
                              batch_size=4, holdout_every=4, feature_layers=feature_layers)
    training_prompts = [random_tokens((6,), model.config.vocab_size, seed=s).tolist() for s in range(8)]
    cache = tmp_path / "sequences.npz"
    params, vocab_ids, figures = train_eagle(model, cfg, prompts=training_prompts, sequences_file=str(cache))
    losses = [e["loss"] for e in figures["epochs"]]
    assert 0 < losses[-1] < 0.9 * losses[0], losses
    assert figures["sequences"] == 16 and cache.exists()
    assert len(figures["final_held_out_agreement"]) == cfg.ttt_steps
    assert params.feature_layers == (() if feature_layers == () else (1,))  # "auto" on 2 layers: the last, fused
    path = save_eagle_head(params, vocab_ids, model, tmp_path / "head", figures)
    plain = [o.token_ids for o in engine(model).generate(prompts(4), GREEDY)]
    eng = engine(model, SpeculativeConfig("eagle", 3, draft=str(path)))
    assert [o.token_ids for o in eng.generate(prompts(4), GREEDY)] == plain


@pytest.mark.slow
def test_shipped_head_loads_and_drafts_the_target_s_tokens(smollm2_gguf):
    """checkpoints/smollm2_eagle: < 20 MB on disk, binds to SmolLM2, and on a fixed chat turn
    its first draft (teacher-forced, the unrolled training head) is the target's greedy token
    far more often than its untrained init's."""
    import subprocess

    from jaxinfer.loading import load_model
    from jaxinfer.speculative.eagle.checkpoint import DEFAULT_EAGLE_PATH
    from jaxinfer.speculative.train.eagle import teacher_features

    size = int(subprocess.run(["du", "-sk", str(DEFAULT_EAGLE_PATH)], capture_output=True, text=True,
                              check=True).stdout.split()[0])
    assert size < 20 * 1024, f"{DEFAULT_EAGLE_PATH} takes {size} KiB on disk"
    target = load_model(smollm2_gguf, progress=False)
    head = load_eagle_head(target)
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Explain why the sea is salty."}])
    text += ("The sea is salty because rivers carry dissolved minerals from rocks into the ocean. When water "
             "evaporates, the salt stays behind, so over millions of years it builds up.")
    ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
    data = teacher_features(target, [ids], np.asarray([0]), np.asarray([0]), top_k=1,
                            feature_layers=head.feature_layers)
    greedy = data.distill.top_ids[0, 1 : len(ids), 0]  # the target's token after pair t's next token: x_{t+2}

    def agreement(params) -> float:
        logits = ttt_logits(params, head.embed, head.lm_head, target.config, jnp.asarray(ids[None]),
                            jnp.asarray(data.features[:, : len(ids)], jnp.float32), steps=1)[0]
        drafted = head.vocab_ids[np.asarray(jnp.argmax(logits[0], -1))][:-1]
        return float(np.mean(drafted == greedy))

    trained, init = agreement(head.params), agreement(init_eagle_params(target, 0, head.feature_layers))
    # 69 pairs, about half of them the (memorised) system prompt; measured with the shipped head:
    # trained 39/69 = 0.565, untrained 0/69.
    assert trained > 0.5 and init < 0.2, (trained, init)

