"""Speculative decoding through the engine: exact greedy equality, the sampled distribution, metrics."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxinfer.speculative.verify
from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.speculative import DraftModel, SpeculativeConfig, propose_ngram
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.loading import Model
from jaxinfer.model import forward
from jaxinfer.sampling import SamplingArrays, SamplingParams, filter_logits
from tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
P_THRESHOLD = 1e-3  # chi-square: "rejects" means p < 1e-3


@pytest.fixture(scope="module")
def model() -> Model:
    config, params = tiny_model(max_position=512)
    return Model(config=config, params=params, tokenizer=None)


def draft_sources(model: Model) -> dict[str, SpeculativeConfig]:
    c, p = model.config, model.params
    other_config, other_params = tiny_model(seed=1, max_position=512, n_layers=1)
    ids = np.arange(0, c.vocab_size, 2)  # a head over half the vocabulary (FR-Spec style)
    subset = DraftModel(c, dataclasses.replace(p, lm_head=p.lm_head[ids]), vocab_ids=ids)
    return {
        "ngram": SpeculativeConfig("ngram", 4),
        "self": SpeculativeConfig("self", 3, self_layers=1),
        "draft": SpeculativeConfig("draft", 4, draft=DraftModel(other_config, other_params)),
        "draft-subset": SpeculativeConfig("draft", 2, draft=subset),
    }


def engine(model, speculative=None, **kw) -> Engine:
    return Engine(model, EngineConfig(**({"max_slots": 4, "page_size": 8, "prefill_chunk": 8, "max_model_len": 64,
                                          "speculative": speculative} | kw)))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = [rng.integers(0, 97, int(rng.integers(1, 40))).tolist() for _ in range(n)]
    out[0] = [5, 6, 7, 8, 9] * 5  # repeats: n-gram drafts have something to find
    shared = rng.integers(0, 97, 17).tolist()
    return out + [shared + [1, 2], shared + [3]]  # a shared prefix for the prefix cache


@pytest.fixture(scope="module")
def plain_tokens(model) -> list[list[int]]:
    return [o.token_ids for o in engine(model, num_pages=TIGHT).generate(prompts(8), GREEDY)]


TIGHT = 9  # 8 pages of 8 tokens for up to 4 sequences of <= 60 tokens: preemption happens


@pytest.mark.parametrize("source", ["ngram", "draft", *(pytest.param(s, marks=pytest.mark.extended) for s in ("self", "draft-subset"))])
def test_greedy_speculation_equals_plain_decoding(model, plain_tokens, source):
    """With continuous batching, chunked prefill, prefix hits and preemption."""
    eng = engine(model, draft_sources(model)[source], num_pages=TIGHT)
    assert [o.token_ids for o in eng.generate(prompts(8), GREEDY)] == plain_tokens
    m = eng.metrics()
    assert m.speculative.drafted.sum() > 0 and m.preemptions > 0 and m.prefix_hits > 0
    assert eng.scheduler.allocator.num_allocated == 0


def test_seeded_ngram_speculation_equals_plain_sampling_token_for_token(model):
    """n-gram drafts are verified by matching the target's own seeded draw at each position
    (`verify_step`): sampled requests give plain decoding's tokens, with prefix hits and
    preemptions moving the verify blocks around (the rejection rule with one key per block
    gave other, equally distributed, tokens)."""
    sp = [SamplingParams(temperature=[0.5, 0.3][i % 2], top_p=[1.0, 0.9][i % 3 > 0], top_k=[0, 20][i % 4 == 1],
                         seed=i, max_tokens=24, ignore_eos=True) for i in range(10)]
    ps = prompts(8)
    plain = [o.token_ids for o in engine(model).generate(ps, sp)]
    eng = engine(model, draft_sources(model)["ngram"], num_pages=TIGHT)
    assert [o.token_ids for o in eng.generate(ps, sp)] == plain
    m = eng.metrics()
    assert m.speculative.accepted.sum() > 0 and m.speculative.accepted.sum() < m.speculative.drafted.sum()
    assert m.preemptions > 0 and m.prefix_hits > 0


def test_speculation_over_an_int8_cache_equals_plain_int8(model):
    """Per-token quantized pages: rejected drafts' K/V is simply overwritten later."""
    ps = prompts(4)
    plain = [o.token_ids for o in engine(model, kv_cache="int8").generate(ps, GREEDY)]
    eng = engine(model, draft_sources(model)["draft"], kv_cache="int8")
    assert [o.token_ids for o in eng.generate(ps, GREEDY)] == plain
    assert 0 < eng.metrics().speculative.accepted.sum() < eng.metrics().speculative.drafted.sum()


def test_a_draft_equal_to_the_target_is_always_accepted(model):
    eng = engine(model, SpeculativeConfig("draft", 4, draft=DraftModel(model.config, model.params)))
    outs = eng.generate(prompts(6), GREEDY)
    s = eng.metrics().speculative
    assert s.acceptance_per_position == (1.0, 1.0, 1.0, 1.0)
    # 20 tokens in blocks of k + 1 = 5: four target calls each (the first token comes from
    # the prefill, or from a decode call when the last prompt chunk is a single token)
    assert all(o.metrics.speculative.target_calls == 4 for o in outs)
    assert s.target_calls == sum(o.metrics.speculative.target_calls for o in outs)
    assert s.emitted == sum(o.metrics.speculative.emitted for o in outs)


def test_a_request_can_opt_out_and_max_tokens_is_never_exceeded(model):
    eng = engine(model, SpeculativeConfig("draft", 4, draft=DraftModel(model.config, model.params)))
    ps = prompts(3)[:3]
    sp = [GREEDY, dataclasses.replace(GREEDY, speculative=False), dataclasses.replace(GREEDY, max_tokens=3)]
    outs = eng.generate(ps, sp)
    plain = engine(model).generate(ps, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert outs[1].metrics.speculative.drafted.sum() == 0
    assert outs[1].metrics.speculative.tokens_per_call == 1.0
    assert len(outs[2].token_ids) == 3


@pytest.mark.parametrize("source", ["ngram", *(pytest.param(s, marks=pytest.mark.extended) for s in ("self", "draft-subset", "eagle"))])
def test_verify_rows_shrink_to_the_requests_decoding_and_change_no_token(model, source):
    """A decode-only speculative step verifies one block per decoding request, packed into
    the smallest row bucket (a lone request on 8 slots verifies [1, k + 1], not [8, k + 1]),
    and every token, logprob and acceptance count is what the engine gives with all
    max_slots rows every step."""
    from test_eagle import random_head
    from test_engine import assert_same_outputs, record_dispatches

    sources = draft_sources(model) | {"eagle": SpeculativeConfig("eagle", 3, draft=random_head(model))}
    ps = prompts(9, seed=4)
    lengths = [60, 12, 50, 16, 8, 30, 14, 6, 24, 10, 40]  # 4 or fewer decode for a while, then one
    sp = [SamplingParams(temperature=[0, 1.0][i % 2], top_k=[0, 5][i % 3 > 0], seed=i, ignore_eos=True,
                         max_tokens=n, logprobs=2 if i % 4 == 0 else None) for i, n in enumerate(lengths)]
    shape = dict(max_slots=8, max_model_len=128, prefill_chunk=32)
    full = engine(model, sources[source], decode_row_buckets=(8,), **shape)
    expected = full.generate(ps, sp)
    eng = engine(model, sources[source], decode_row_buckets=(1, 4), **shape)
    assert eng.decode_row_buckets == [1, 4, 8]
    dispatched = record_dispatches(eng)
    outs = eng.generate(ps, sp)
    assert_same_outputs(outs, expected)
    steps = [(batch.prefill is not None, len(batch.decode_active), int(batch.decode_active.sum()), drafts is not None)
             for batch, drafts in dispatched]
    for out, ref in zip(outs, expected):
        s, r = out.metrics.speculative, ref.metrics.speculative
        assert (s.drafted.tolist(), s.accepted.tolist()) == (r.drafted.tolist(), r.accepted.tolist())
    decode_only = [(rows, n, spec) for prefill, rows, n, spec in steps if not prefill]
    assert all(rows == min(r for r in (1, 4, 8) if r >= n) for rows, n, _ in decode_only)
    if source == "eagle":  # the target features each slot carried last (acceptance alone is blind to them)
        np.testing.assert_allclose(eng.draft_kv.features, full.draft_kv.features, rtol=0, atol=1e-4)
    packed = {rows for rows, _, spec in decode_only if spec}  # rows of the steps that verified blocks
    assert (4 in packed) if source == "ngram" else ({1, 4} <= packed)  # n-gram: alone, it found no match
    assert eng.metrics().speculative.drafted.sum() > 0


@pytest.mark.parametrize("source", ["draft", "ngram"])
def test_speculation_compiles_nothing_after_warmup(model, source):
    eng = engine(model, draft_sources(model)[source], num_pages=TIGHT)
    eng.warmup(logprobs=True)
    before = eng.metrics().obtained_programs
    rng = np.random.default_rng(3)
    ps = [rng.integers(0, 97, int(rng.integers(1, 34))).tolist() for _ in range(30)]
    sp = [SamplingParams(temperature=float(rng.choice([0.0, 1.0])), top_k=int(rng.integers(0, 5)),
                         max_tokens=int(rng.integers(1, 30)), ignore_eos=True, seed=i,
                         logprobs=1 if i % 3 == 0 else None) for i in range(30)]
    eng.generate(ps, sp)
    assert eng.metrics().obtained_programs == before


@pytest.mark.parametrize("source", ["ngram", pytest.param("self", marks=pytest.mark.extended)])
def test_speculation_pauses_while_many_requests_decode(model, plain_tokens, source):
    """`disable_by_batch_size=3`: steps with 3 or more decoding requests run the plain program
    (compiled at warm-up, nothing after), the others speculate; tokens are plain decoding's."""
    from test_engine import record_dispatches

    config = dataclasses.replace(draft_sources(model)[source], disable_by_batch_size=3)
    eng = engine(model, config)  # pages for every slot: 4 requests decode at once
    eng.warmup()
    before = eng.metrics().obtained_programs
    dispatched = record_dispatches(eng)
    assert [o.token_ids for o in eng.generate(prompts(8), GREEDY)] == plain_tokens
    assert eng.metrics().obtained_programs == before
    steps = [(int(batch.decode_active.sum()), drafts is not None) for batch, drafts in dispatched]
    assert all(n < 3 for n, drafted in steps if drafted)
    assert any(n >= 3 for n, _ in steps) and any(drafted for _, drafted in steps)
    assert eng.metrics().speculative.drafted.sum() > 0


def test_bad_speculative_configs_are_rejected(model):
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="num_speculative"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="needs draft"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="num_layers"):
        engine(model, SpeculativeConfig("self", 2, self_layers=2))
    other_vocab = DraftModel(*tiny_model(vocab_size=50))
    with pytest.raises(ValueError, match="tokenizer"):
        engine(model, SpeculativeConfig("draft", 2, draft=other_vocab))
    with pytest.raises(ValueError, match="KIVI"):
        engine(model, SpeculativeConfig("ngram"), kv_cache="int4")
    with pytest.raises(ValueError, match="streaming"):
        EngineConfig(speculative=SpeculativeConfig("ngram"), streaming=(4, 16))
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            SpeculativeConfig("ngram", disable_by_batch_size=bad)
    with pytest.raises(ValueError, match="disable_by_batch_size works with 'ngram' and 'self'"):
        SpeculativeConfig("eagle", disable_by_batch_size=4)
    with pytest.raises(ValueError, match="num_speculative=True"):
        SpeculativeConfig("ngram", True)
    with pytest.raises(ValueError, match="draft= is for 'draft' and 'eagle'"):
        SpeculativeConfig("ngram", 4, draft="/nonexistent")


def test_vllms_speculative_config_dict():
    """vLLM's `speculative_config`: its keys and method names map onto SpeculativeConfig;
    unknown keys are named, not ignored."""
    from jaxinfer.speculative.checkpoint import DEFAULT_DRAFT_PATH
    from jaxinfer.speculative.eagle import DEFAULT_EAGLE_PATH

    ngram = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    assert SpeculativeConfig.from_vllm(ngram) == SpeculativeConfig("ngram", 5, ngram_max=4, ngram_min=1)
    assert SpeculativeConfig.from_vllm({"prompt_lookup_max": 1}) == SpeculativeConfig("ngram", ngram_max=1, ngram_min=1)
    for method in ("eagle", "eagle3"):
        assert SpeculativeConfig.from_vllm({"method": method, "num_speculative_tokens": 2}) == SpeculativeConfig(
            "eagle", 2, draft=str(DEFAULT_EAGLE_PATH))
    assert SpeculativeConfig.from_vllm({"model": "/d", "num_speculative_tokens": 3}) == SpeculativeConfig("draft", 3, draft="/d")
    assert SpeculativeConfig.from_vllm({"method": "draft_model"}).draft == str(DEFAULT_DRAFT_PATH)
    assert EngineConfig(speculative={"method": "ngram"}).speculative == SpeculativeConfig("ngram")
    for bad, needle in [({"method": "medusa"}, "method='medusa'"), ({"num_speculative_tokens": 2}, "needs a method"),
                        ({"method": "ngram", "draft_tensor_parallel_size": 1}, "['draft_tensor_parallel_size']"),
                        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative=0")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            SpeculativeConfig.from_vllm(bad)


@pytest.mark.parametrize("tied", [False, True])
def test_a_vocab_subset_draft_scores_the_full_heads_logits_at_its_ids(model, tied):
    c, p = model.config, model.params
    if tied:  # the head is the embedding (SmolLM2)
        p = dataclasses.replace(p, lm_head=None)
    ids = np.asarray([3, 96, 0, 41, 7], np.int32)
    draft = DraftModel.with_vocab_subset(c, p, ids)
    assert draft.params.lm_head.shape == (len(ids), c.d_model) and draft.params.embed.shape == p.embed.shape
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, c.vocab_size, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    spec = KVCacheSpec(num_pages=5, page_size=8, max_slots=2, max_pages_per_seq=1)

    def logits(params):
        kv = init_paged_kv(c, spec).replace(block_tables=jnp.asarray([[1], [2]], jnp.int32))
        return np.asarray(forward(params, c, tokens, positions, kv)[0])

    np.testing.assert_allclose(logits(draft.params), logits(p)[..., ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="full-vocabulary head"):
        DraftModel.with_vocab_subset(c, draft.params, ids)


def test_ngram_proposals_follow_the_latest_match():
    t = np.asarray([1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2], np.int32)
    assert propose_ngram(t, 3).tolist() == [5, 6, 1]  # "1 2" last seen at 5, followed by 5 6 1
    assert propose_ngram(t, 3, ngram_max=1).tolist() == [5, 6, 1]
    assert propose_ngram(np.asarray([7, 8, 9], np.int32), 2).tolist() == []
    assert propose_ngram(np.asarray([4, 4], np.int32), 4).tolist() == [4]
    assert propose_ngram(np.asarray([1, 2, 3, 1, 2, 3, 1, 2], np.int32), 5, ngram_min=3).tolist() == [3, 1, 2]


# ---- the sampled distribution, end to end ------------------------------------------------------

VOCAB = 6
PROMPT = [1, 2, 3, 4]
SAMPLES = 3000
SETTINGS = {
    "temperature-1": dict(temperature=1.0),
    "top-k-3": dict(temperature=1.0, top_k=3),
    "top-p-0.7": dict(temperature=0.9, top_p=0.7),
}


@pytest.fixture(scope="module")
def small_vocab() -> tuple[Model, DraftModel]:
    config, params = tiny_model(seed=3, vocab_size=VOCAB, max_position=64)
    draft_config, draft_params = tiny_model(seed=11, vocab_size=VOCAB, max_position=64, n_layers=1)
    return Model(config, params, None), DraftModel(draft_config, draft_params)


def first_three(model: Model, settings: dict, speculative: SpeculativeConfig | None) -> np.ndarray:
    """The first three generated tokens of SAMPLES requests (seeds 0..) -> i64[SAMPLES]: cell ids."""
    eng = Engine(model, EngineConfig(max_slots=64, page_size=4, prefill_chunk=4, max_prefill_rows=32,
                                     max_model_len=16, enable_prefix_caching=False, speculative=speculative))
    sp = [SamplingParams(max_tokens=6, ignore_eos=True, seed=i, **settings) for i in range(SAMPLES)]
    outs = eng.generate([PROMPT] * SAMPLES, sp)
    tokens = np.asarray([o.token_ids[:3] for o in outs])
    assert tokens.min() >= 0 and tokens.max() < VOCAB
    return tokens @ np.asarray([VOCAB**2, VOCAB, 1])


def exact_first_three(model: Model, settings: dict) -> tuple[np.ndarray, np.ndarray]:
    """Target probability of every 3-token continuation, and whether each is allowed
    (every token inside its top-k / top-p set): f64[V^3], bool[V^3]."""
    cells = np.stack(np.meshgrid(*[np.arange(VOCAB)] * 3, indexing="ij"), -1).reshape(-1, 3)
    seqs = np.concatenate([np.tile(PROMPT, (len(cells), 1)), cells], axis=1).astype(np.int32)
    spec = KVCacheSpec.for_batch(len(seqs), seqs.shape[1], page_size=8)
    kv = init_paged_kv(model.config, spec)
    kv = kv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32).reshape(spec.max_slots, -1))
    positions = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    logits, _ = forward(model.params, model.config, jnp.asarray(seqs), positions, kv)
    logits = np.asarray(logits)[:, len(PROMPT) - 1 : -1].reshape(-1, VOCAB)  # before each of the 3 tokens
    params = SamplingParams(**settings)
    rows = SamplingArrays.from_params([params] * len(logits), [0] * len(logits))
    filtered = np.asarray(filter_logits(jnp.asarray(logits), rows), np.float64)
    probs = np.exp(filtered - filtered.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = probs[np.arange(len(probs)), cells.reshape(-1)].reshape(-1, 3)
    return chosen.prod(axis=1), (chosen > 0).all(axis=1)


def chi_square_p(cells: np.ndarray, expected: np.ndarray) -> float:
    """Goodness of fit of sampled cells to `expected` probabilities; cells expected < 5 times
    are pooled into one so the chi-square approximation holds."""
    observed = np.bincount(cells, minlength=len(expected)).astype(float)
    exp = expected * len(cells)
    big = exp >= 5
    obs_pooled = np.append(observed[big], observed[~big].sum())
    exp_pooled = np.append(exp[big], exp[~big].sum())
    keep = exp_pooled > 0
    return float(stats.chisquare(obs_pooled[keep], exp_pooled[keep] * obs_pooled[keep].sum() / exp_pooled[keep].sum()).pvalue)


# one setting by default: top-p at temperature 0.9 goes through every filter and the residual
@pytest.mark.parametrize("setting", [s if s == "top-p-0.7" else pytest.param(s, marks=pytest.mark.extended) for s in SETTINGS])
def test_sampled_speculation_keeps_the_target_distribution(small_vocab, setting):
    model, draft = small_vocab
    expected, allowed = exact_first_three(model, SETTINGS[setting])
    for speculative in (None, SpeculativeConfig("draft", 3, draft=draft), SpeculativeConfig("ngram", 3)):
        cells = first_three(model, SETTINGS[setting], speculative)
        assert allowed[cells].all(), "a token outside the top-k / top-p set was emitted"
        p = chi_square_p(cells, expected)
        assert p > P_THRESHOLD, (speculative and speculative.method, p)


@pytest.mark.extended
def test_the_chi_square_check_rejects_a_wrong_residual(small_vocab, monkeypatch):
    """Power: sampling the correction from p instead of normalize(max(p - q, 0)) is caught."""
    model, draft = small_vocab
    expected, _ = exact_first_three(model, SETTINGS["temperature-1"])
    monkeypatch.setattr(jaxinfer.speculative.verify, "residual_distribution", lambda p, q: p)
    jax.clear_caches()  # retrace the step with the planted bug
    try:
        cells = first_three(model, SETTINGS["temperature-1"], SpeculativeConfig("draft", 3, draft=draft))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert chi_square_p(cells, expected) < P_THRESHOLD
