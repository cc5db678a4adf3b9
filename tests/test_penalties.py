"""Repetition / frequency / presence penalties, logit bias and min_tokens: against a
reference decoding loop (greedy and seeded sampling), HF transformers' repetition penalty
and min_new_tokens, and through preemption, prefix caching, asynchronous scheduling and
slot reuse."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.loading import Model, load_model
from jaxinfer.model import forward
from jaxinfer.sampling import SamplingArrays, SamplingParams, sample_tokens
from jaxinfer.speculative import DraftModel
from test_engine import engine, model  # noqa: F401 - the tiny model fixture and engine shapes the engine tests use

BASE = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PENALTIES = {
    "repetition": dict(repetition_penalty=1.6),
    "repetition_below_1": dict(repetition_penalty=0.7),
    "frequency_presence": dict(frequency_penalty=1.3, presence_penalty=0.6),
    "negative_frequency": dict(frequency_penalty=-0.8),
    "bias": dict(logit_bias={3: 6.0, 11: -100.0, 50: 2.5}),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.4, logit_bias={7: 3.0}),
    "allowed": dict(allowed_token_ids=[13, 3, 5, 8, 3], logit_bias={5: 1.5, 40: 9.0}, repetition_penalty=1.2),
}


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 20, int(rng.integers(lo, hi))).tolist() for _ in range(n)]  # few ids: many repeats


def reference_penalize(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams,
                       stop_ids: set[int] = frozenset()) -> np.ndarray:
    """The penalties as vLLM / OpenAI / HF define them, token by token: bias, repetition,
    then frequency and presence (float32, like the device); no token of `stop_ids` before
    min_tokens are out."""
    x = logits.astype(np.float32).copy()
    for token, value in p.logit_bias:
        x[token] += np.float32(value)
    if p.allowed_token_ids is not None:
        x[np.setdiff1d(np.arange(len(x)), p.allowed_token_ids)] = -np.inf
    r = np.float32(p.repetition_penalty)
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(output):
        count = output.count(token)
        x[token] = x[token] - np.float32(p.frequency_penalty) * count - np.float32(p.presence_penalty)
    if len(output) < p.min_tokens:
        x[list(stop_ids)] = -np.inf
    return x


def last_logits(model: Model, tokens: list[int], padded: int = 128) -> np.ndarray:
    """The model's logits after `tokens`, from one dense causal forward padded to `padded`
    tokens (one compiled shape; padding after the last token changes nothing): f32[V]."""
    spec = KVCacheSpec.for_batch(1, padded, page_size=4)
    kv = init_paged_kv(model.config, spec)
    kv = kv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32).reshape(1, -1))
    ids = np.zeros((1, padded), np.int32)
    ids[0, : len(tokens)] = tokens
    logits, _ = dense_forward(model.params, model.config, jnp.asarray(ids), jnp.arange(padded)[None], kv)
    return np.asarray(logits[0, len(tokens) - 1])


dense_forward = jax.jit(forward, static_argnames=("config",))
sample = jax.jit(sample_tokens)


def reference_decode(model: Model, prompt: list[int], p: SamplingParams, seed: int = 0) -> list[int]:
    """Decode with a dense forward over the whole sequence per token, penalizing on the host
    and sampling with `sample_tokens` at the engine's key (seed, length), until max_tokens
    or a stop id (EOS unless ignored)."""
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(model.config.eos_ids))
    out: list[int] = []
    while len(out) < p.max_tokens and not stop_ids.intersection(out[-1:]):
        x = reference_penalize(last_logits(model, prompt + out), prompt, out, p, stop_ids)
        arrays = SamplingArrays.from_params([p], [seed])
        out.append(int(sample(jnp.asarray(x)[None], arrays, jnp.asarray([len(prompt) + len(out)]))[0]))
    return out


@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalized_greedy_decoding_matches_the_reference_and_leaves_others_alone(model, name):
    """Two penalized requests beside two plain ones on one engine: the penalized ones equal
    the reference loop token for token, the plain ones an engine that never saw penalties."""
    ps = prompts(4, seed=1)
    penalized = dataclasses.replace(BASE, **PENALTIES[name])
    params = [penalized, BASE, penalized, BASE]
    outs = engine(model).generate(ps, params)
    plain = engine(model).generate(ps, BASE)
    for p, sp, out, ref in zip(ps, params, outs, plain):
        want = reference_decode(model, p, sp) if sp.penalized else ref.token_ids
        assert out.token_ids == want
    assert outs[0].token_ids != plain[0].token_ids  # the penalty changed something


def test_seeded_sampling_penalizes_before_temperature_and_filters(model):
    """Sampled tokens equal the reference's, drawn at the same keys: the penalties act on
    the raw logits, before temperature, top-k and top-p."""
    ps = prompts(3, seed=2)
    params = [SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=5 + i, max_tokens=16, ignore_eos=True,
                             **PENALTIES["all"]) for i in range(3)]
    outs = engine(model).generate(ps, params)
    for p, sp, out in zip(ps, params, outs):
        assert out.token_ids == reference_decode(model, p, sp, seed=sp.seed)


@pytest.mark.parametrize("setting", ["preemption", "prefix_cache", "async", "chunked"])
def test_penalties_survive_preemption_prefix_hits_and_asynchronous_steps(model, setting):
    """The slot's history comes from the host at admission, so recomputation after a
    preemption, a prefix-cache hit and asynchronous scheduling change no token."""
    system = prompts(1, seed=3, lo=17, hi=18)[0]
    ps = [system + tail for tail in prompts(6, seed=4, lo=2, hi=12)]
    params = [dataclasses.replace(BASE, max_tokens=16, **PENALTIES["all" if i % 2 else "frequency_presence"])
              for i in range(6)]
    want = [reference_decode(model, p, sp) for p, sp in zip(ps, params)]
    kw = {"preemption": dict(num_pages=12), "prefix_cache": {}, "async": dict(async_scheduling=True),
          "chunked": dict(prefill_chunk=3, max_slots=2)}[setting]
    eng = engine(model, **kw)
    outs = eng.generate(ps[:1], params[:1]) + eng.generate(ps[1:], params[1:])
    assert [o.token_ids for o in outs] == want
    if setting == "preemption":
        assert eng.metrics().preemptions > 0
    if setting == "prefix_cache":
        assert eng.metrics().prefix_hits > 0


def test_a_slot_forgets_its_previous_requests_history(model):
    """On 2 slots: a short penalized request and a long one start; a plain request then
    takes the first one's slot while the long one still decodes (so its steps penalize),
    and a penalized one takes a slot after it. Each sees its own history only."""
    ps = prompts(4, seed=5)
    params = [dataclasses.replace(BASE, max_tokens=3, **PENALTIES["all"]),
              dataclasses.replace(BASE, max_tokens=30, **PENALTIES["frequency_presence"]), BASE,
              dataclasses.replace(BASE, **PENALTIES["repetition"])]
    eng = engine(model, max_slots=2)
    outs = eng.generate(ps, params)
    assert outs[2].token_ids == engine(model).generate([ps[2]], BASE)[0].token_ids
    for i in (0, 1, 3):
        assert outs[i].token_ids == reference_decode(model, ps[i], params[i])
    before = eng.metrics().obtained_programs
    eng.generate(ps, params)  # every program (with and without penalties) ran already
    assert eng.metrics().obtained_programs == before


def test_min_tokens_bans_stop_ids_and_eos_until_then(model):
    """Requests whose greedy output holds a stop id (or EOS) at its second token: with
    min_tokens they go on, and equal the reference that bans the stop tokens until then;
    beside them a plain request and one that stops as soon as it may."""
    ps = prompts(4, seed=7)
    first = [o.token_ids for o in engine(model).generate(ps, BASE)]
    eos_model = Model(config=model.config.replace(eos_ids=(first[1][1],)), params=model.params, tokenizer=None)
    params = [dataclasses.replace(BASE, min_tokens=8, stop_token_ids=(first[0][1],)),
              SamplingParams(temperature=0.9, seed=3, max_tokens=20, min_tokens=6),  # stops at EOS after 6
              BASE, dataclasses.replace(BASE, stop_token_ids=(first[3][1],)),
              dataclasses.replace(BASE, min_tokens=5, stop_token_ids=(9,), logit_bias={9: 100.0})]  # 9 when allowed
    outs = engine(eos_model).generate(ps + ps[:1], params)
    for p, sp, out in zip(ps + ps[:1], params, outs):
        assert out.token_ids == reference_decode(eos_model, p, sp, seed=sp.seed or 0)
    assert len(outs[0].token_ids) > 8 and outs[3].token_ids == first[3][:2]
    assert outs[2].token_ids == first[2] and outs[4].token_ids[5:] == [9] and 9 not in outs[4].token_ids[:5]


def test_block_positions_are_penalized_as_if_the_drafts_before_them_were_kept():
    """Every logit of a speculative block (not only the argmax that greedy tests see):
    position j equals the reference penalties with the block's tokens up to j in the
    output, tokens the host already counted not counted twice."""
    from jaxinfer.penalties import init_penalty_state, penalize_block, set_slot, slot_history

    rng = np.random.default_rng(11)
    vocab, t = 24, 4
    prompt, output = rng.integers(0, vocab, 7).tolist(), rng.integers(0, vocab, 3).tolist()
    p = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=-0.3, logit_bias={2: 1.5},
                       min_tokens=5, stop_token_ids=(4, 9))
    state = set_slot(init_penalty_state(2, vocab), np.int32(1), slot_history(vocab, prompt, output, p))
    # the block re-feeds the last output token (the host counted it: position 9) and 3 drafts
    fed = [output[-1], *rng.integers(0, vocab, t - 1).tolist()]
    positions = len(prompt) + len(output) - 1 + np.arange(t)
    logits = rng.normal(size=(1, t, vocab)).astype(np.float32) * 3
    got = penalize_block(jnp.asarray(logits), state, jnp.asarray([1]), jnp.asarray([fed]), jnp.asarray([positions]),
                         jnp.asarray([True]))
    for j in range(t):
        want = reference_penalize(logits[0, j], prompt, output + fed[1 : j + 1], p, {4, 9})
        np.testing.assert_allclose(np.asarray(got[0, j]), want, rtol=1e-6)


SPECULATIVE_PARAMS = [dataclasses.replace(BASE, **PENALTIES["all"]), dataclasses.replace(BASE, **PENALTIES["repetition"]),
                      dataclasses.replace(BASE, min_tokens=12, stop_token_ids=(6, 7, 8), logit_bias={6: 8.0}), BASE,
                      dataclasses.replace(BASE, **PENALTIES["frequency_presence"])]


@pytest.mark.parametrize("source", ["ngram", *(pytest.param(s, marks=pytest.mark.extended) for s in ("draft", "eagle"))])
def test_speculative_decoding_keeps_penalized_tokens_exact(model, source):
    """Greedy speculative decoding with penalties, bias and min_tokens gives the plain
    engine's tokens, token for token, from every draft source: each block position is
    scored with the drafts before it counted, and the step counts only what it kept. (The
    random tiny model's n-gram and EAGLE drafts are all rejected: those cover the one-token
    path of both step functions.)"""
    from test_eagle import random_head

    sources = {"ngram": SpeculativeConfig("ngram", 4), "draft": SpeculativeConfig("draft", 4, draft=DraftModel(model.config, model.params)),
               "eagle": SpeculativeConfig("eagle", 3, draft=random_head(model))}
    ps = [[5, 6, 7, 8] * 6, *prompts(3, seed=9), [9, 6, 7, 8] * 3]
    want = engine(model).generate(ps, SPECULATIVE_PARAMS)
    eng = engine(model, speculative=sources[source])
    outs = eng.generate(ps, SPECULATIVE_PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    if source == "draft":  # the target drafting for itself: its blocks keep several drafts
        assert max(int(o.metrics.speculative.accepted[1]) for o in outs) > 0


def test_logprobs_stay_those_of_the_raw_logits(model):
    """As in vLLM: a penalty changes which token is drawn, not the logprob reported for it."""
    p = prompts(1, seed=6)[0]
    with_bias = dataclasses.replace(BASE, max_tokens=6, logprobs=2, logit_bias={5: 100.0})
    out = engine(model).generate([p], with_bias)[0]
    assert out.token_ids == [5] * 6
    plain = engine(model).generate([p], dataclasses.replace(BASE, max_tokens=1, logprobs=2))[0]
    raw = last_logits(model, p).astype(np.float64)
    log_softmax = raw - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    np.testing.assert_allclose(out.logprobs[0], log_softmax[5], atol=1e-5)
    assert out.top_logprobs[0] == plain.top_logprobs[0]


def test_bad_penalties_raise_naming_the_field(model):
    cases = [
        (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
        (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={i: 1 for i in range(2000)}), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=21), "min_tokens"), (dict(min_tokens=2.0), "min_tokens"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(allowed_token_ids="ab"), "allowed_token_ids"), (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    ]
    for changes, field in cases:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(BASE, **changes)
    eng = engine(model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 2], dataclasses.replace(BASE, logit_bias={97: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids: token ids \\[97\\] are outside"):
        eng.add_request([1, 2], dataclasses.replace(BASE, allowed_token_ids=[1, 97]))
    assert not eng.has_unfinished_requests() and eng.penalties is None


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_matches_transformers(tmp_path, penalty):
    """HF's RepetitionPenaltyLogitsProcessor over prompt and output, greedy."""
    import torch

    from test_model_parity import save_tiny_llama

    hf = save_tiny_llama(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    hf.generation_config.eos_token_id = None
    prompt = np.random.default_rng(7).integers(0, 40, 16).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])  # (an explicit mask: HF would take the prompt's 0s for padding)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          pad_token_id=0, repetition_penalty=penalty)[0, len(prompt):].tolist()
    eng = Engine(load_model(tmp_path), EngineConfig(max_slots=2, page_size=8, prefill_chunk=8, max_model_len=64))
    out = eng.generate([prompt], dataclasses.replace(BASE, max_tokens=24, repetition_penalty=penalty))
    assert out[0].token_ids == ref


def test_min_tokens_matches_transformers_min_new_tokens(tmp_path):
    """HF's MinNewTokensLengthLogitsProcessor: EOS (here a token greedy decoding reaches at
    its second step) cannot come before min_new_tokens, greedy."""
    import torch

    from test_model_parity import save_tiny_llama

    hf = save_tiny_llama(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    prompt = np.random.default_rng(8).integers(0, 40, 12).tolist()
    eng = Engine(load_model(tmp_path), EngineConfig(max_slots=2, page_size=8, prefill_chunk=8, max_model_len=64))
    eos = eng.generate([prompt], dataclasses.replace(BASE, max_tokens=2))[0].token_ids[1]
    hf.generation_config.eos_token_id = eos
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=10,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    out = eng.generate([prompt], dataclasses.replace(BASE, max_tokens=24, min_tokens=10, stop_token_ids=(eos,)))
    assert out[0].token_ids == ref and len(ref) > 10
