"""Repetition / frequency / presence penalties and logit bias: against a reference decoding
loop (greedy and seeded sampling), HF transformers' repetition penalty, and through
preemption, prefix caching, asynchronous scheduling and slot reuse."""

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
from test_engine import engine, model  # noqa: F401 - the tiny model fixture and engine shapes the engine tests use

BASE = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PENALTIES = {
    "repetition": dict(repetition_penalty=1.6),
    "repetition_below_1": dict(repetition_penalty=0.7),
    "frequency_presence": dict(frequency_penalty=1.3, presence_penalty=0.6),
    "negative_frequency": dict(frequency_penalty=-0.8),
    "bias": dict(logit_bias={3: 6.0, 11: -100.0, 50: 2.5}),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.4, logit_bias={7: 3.0}),
}


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 20, int(rng.integers(lo, hi))).tolist() for _ in range(n)]  # few ids: many repeats


def reference_penalize(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """The penalties as vLLM / OpenAI / HF define them, token by token: bias, repetition,
    then frequency and presence (float32, like the device)."""
    x = logits.astype(np.float32).copy()
    for token, value in p.logit_bias:
        x[token] += np.float32(value)
    r = np.float32(p.repetition_penalty)
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(output):
        count = output.count(token)
        x[token] = x[token] - np.float32(p.frequency_penalty) * count - np.float32(p.presence_penalty)
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
    and sampling with `sample_tokens` at the engine's key (seed, length)."""
    out: list[int] = []
    for _ in range(p.max_tokens):
        x = reference_penalize(last_logits(model, prompt + out), prompt, out, p)
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
    before = eng.metrics().compiled_programs
    eng.generate(ps, params)  # every program (with and without penalties) ran already
    assert eng.metrics().compiled_programs == before


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
    ]
    for changes, field in cases:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(BASE, **changes)
    eng = engine(model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 2], dataclasses.replace(BASE, logit_bias={97: 1.0}))
    spec = engine(model, speculative=SpeculativeConfig("ngram", 2))
    with pytest.raises(ValueError, match="speculative"):
        spec.add_request([1, 2], dataclasses.replace(BASE, presence_penalty=0.5))
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
