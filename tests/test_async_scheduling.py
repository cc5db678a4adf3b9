"""Asynchronous scheduling: step n + 1 is dispatched before step n's tokens are read, and the
requests get exactly what the synchronous engine gives them."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model() -> Model:
    config, params = tiny_model(max_position=512)
    return Model(config=config, params=params, tokenizer=None)


def engine(model, asynchronous: bool, **kw) -> Engine:
    return Engine(model, EngineConfig(**({"max_slots": 4, "page_size": 4, "prefill_chunk": 8, "max_model_len": 128,
                                          "async_scheduling": asynchronous} | kw)))


def workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1-40 tokens (some repeated: prefix-cache hits) and a mix of greedy and
    seeded sampling, 1-20 new tokens, some stopping on a token id."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(rng.integers(1, 40))).tolist() for _ in range(n)]
    prompts[n // 2] = prompts[0]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=0 if i % 3 else 20, seed=i,
                             max_tokens=int(rng.integers(1, 20)), ignore_eos=True,
                             stop_token_ids=(int(rng.integers(0, 97)),) if i % 4 == 0 else ())
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("config", [
    {},  # 4 slots, one prefill row
    {"num_pages": 24, "max_prefill_rows": 2},  # the pool runs out: preemption
    {"max_slots": 1, "enable_prefix_caching": False},
])
def test_async_outputs_equal_synchronous(model, config):
    prompts, params = workload(12, seed=1)
    outs = {a: engine(model, a, **config).generate(prompts, params) for a in (False, True)}
    for sync, asy in zip(outs[False], outs[True]):
        assert asy.token_ids == sync.token_ids
        assert asy.finish_reason == sync.finish_reason
    if config.get("num_pages"):
        eng = engine(model, True, **config)
        eng.generate(prompts, params)
        assert eng.metrics().preemptions > 0


def test_async_logprobs_equal_synchronous(model):
    prompts, _ = workload(4, seed=2)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3, ignore_eos=True)
    sync, asy = (engine(model, a).generate(prompts, params) for a in (False, True))
    for s, a in zip(sync, asy):
        assert a.token_ids == s.token_ids
        np.testing.assert_allclose(a.logprobs, s.logprobs, rtol=1e-6, atol=1e-6)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in s.top_logprobs]


def test_async_steady_state_compiles_nothing(model):
    eng = engine(model, True)
    eng.warmup()
    before = eng.metrics().obtained_programs
    eng.generate(*workload(10, seed=4))
    assert eng.metrics().obtained_programs == before


def test_async_outputs_arrive_one_step_late_and_the_pool_drains(model):
    eng = engine(model, True, enable_prefix_caching=False)
    eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), request_id="a")
    assert eng.step() == []  # the prefill is dispatched; nothing has been read yet
    first = eng.step()  # the prefill's token, while the first decode runs
    assert [o.token_ids for o in first] == [eng.requests["a"].generated] and len(first[0].token_ids) == 1
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.scheduler.num_allocated == 0 and eng.scheduler.free_slots


def test_async_abort_while_a_step_is_in_flight(model):
    """A request aborted with its token in flight loses it; the others are unaffected and
    its pages go back to the pool."""
    prompts, params = workload(4, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4
    expected = engine(model, False, enable_prefix_caching=False).generate(prompts[1:], params[1:])
    eng = engine(model, True, enable_prefix_caching=False)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs: dict[str, list[int]] = {}
    for _ in range(6):
        for o in eng.step():
            outs[o.request_id] = o.token_ids
    eng.abort(ids[0])
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id != ids[0]
            outs[o.request_id] = o.token_ids
    assert [outs[i] for i in ids[1:]] == [e.token_ids for e in expected]
    assert eng.scheduler.num_allocated == 0


def test_async_scheduling_refuses_speculation_and_non_bools():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, speculative=SpeculativeConfig("ngram", 2))
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


def test_async_slot_goes_to_the_next_request_when_the_last_token_is_dispatched(model):
    """A request whose in-flight token reaches max_tokens hands over its slot at once: one slot
    serving requests back to back takes no more steps than the synchronous engine."""
    prompts, _ = workload(4, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 3, 2, 5)]
    steps = {}
    for a in (False, True):
        eng = engine(model, a, max_slots=1, prefill_chunk=64)
        outs = eng.generate(prompts, params)
        steps[a] = eng.metrics().steps
        assert [len(o.token_ids) for o in outs] == [1, 3, 2, 5]
    assert steps[True] == steps[False] == 4 + sum((1, 3, 2, 5)) - 4
