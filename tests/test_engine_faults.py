"""Fault containment in `Engine.step`: a request that makes a step fail is finished with
finish_reason "error"; every other request keeps its pages and produces exactly the tokens
it would have produced with no bad neighbour."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
from tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CONFIG = EngineConfig(max_slots=4, page_size=4, prefill_chunk=8, max_model_len=64)


@pytest.fixture(scope="module")
def model() -> Model:
    config, params = tiny_model(max_position=64)
    return Model(config=config, params=params, tokenizer=None)


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 97, int(rng.integers(5, 20))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """The good requests' tokens with no bad neighbour."""
    return [o.token_ids for o in Engine(model, CONFIG).generate(prompts(3), GREEDY)]


def run_to_end(eng: Engine, max_steps: int = 500) -> dict[str, object]:
    finals = {}
    for _ in range(max_steps):  # far more than the requests need: a request left stuck fails the test
        if not eng.has_unfinished_requests():
            return finals
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(eng.requests)}")


def altered(params: SamplingParams, **fields) -> SamplingParams:
    """`params` changed after validation (as a caller mutating a frozen dataclass could):
    the values reach the step unchecked."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def start_good_requests(eng: Engine) -> list[str]:
    ids = [eng.add_request(p, GREEDY, request_id=f"good-{i}") for i, p in enumerate(prompts(3))]
    for _ in range(3):  # the good ones hold pages and KV when the bad one arrives
        eng.step()
    return ids


def assert_clean_pool(eng: Engine) -> None:
    assert not eng.requests and eng.scheduler.num_allocated == 0
    eng.scheduler.allocator.check_invariants()


@pytest.mark.parametrize("field, value", [("top_k", 2**40), ("top_k", -(2**40)), ("seed", -1)])
def test_a_row_that_cannot_be_packed_fails_alone(model, reference, caplog, field, value):
    eng = Engine(model, CONFIG)
    good = start_good_requests(eng)
    eng.add_request(prompts(4)[3], altered(SamplingParams(max_tokens=12), **{field: value}), request_id="bad")
    with caplog.at_level(logging.ERROR, logger="jaxinfer.engine.engine"):
        finals = run_to_end(eng)
    bad = finals.pop("bad")
    assert bad.finish_reason == "error" and field in bad.error and bad.token_ids == []
    assert "bad" in caplog.text and field in caplog.text
    assert [finals[i].token_ids for i in good] == reference
    assert all(finals[i].finish_reason == "length" for i in good)
    assert_clean_pool(eng)


def test_a_request_failing_while_its_tokens_are_handled_fails_alone(model, reference):
    """The step ran; handing one request its token raises (say, its text decoding):
    the others still get this step's tokens."""
    eng = Engine(model, CONFIG)
    good = start_good_requests(eng)
    eng.add_request(prompts(4)[3], GREEDY, request_id="bad")
    req, calls = eng.requests["bad"], []

    def append_token(token, now, logprob=None):
        calls.append(token)
        if len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")
        type(req).append_token(req, token, now, logprob)

    req.append_token = append_token
    finals = run_to_end(eng)
    bad = finals.pop("bad")
    assert bad.finish_reason == "error" and "planted" in bad.error
    assert bad.token_ids == calls[:2]  # what it had emitted before the failure
    assert [finals[i].token_ids for i in good] == reference
    assert_clean_pool(eng)


def test_a_step_failing_for_no_single_request_fails_the_running_ones_and_serving_goes_on(model, reference):
    eng = Engine(model, CONFIG)
    first = start_good_requests(eng)
    waiting = [eng.add_request(p, GREEDY) for p in prompts(3) * 2]  # two more than the free slots
    real, failures = eng._step, []

    def device_error_once(*args):
        if not failures:
            failures.append(1)
            raise RuntimeError("planted device error")
        return real(*args)

    eng._step = device_error_once
    finals = run_to_end(eng)
    # The running requests (the first three plus the one admitted into the free slot) fail;
    # the queued ones were not part of the step and finish normally.
    failed = [rid for rid, out in finals.items() if out.finish_reason == "error"]
    assert set(first) <= set(failed) and len(failed) == 4
    assert all("planted device error" in finals[r].error for r in failed)
    survivors = [rid for rid in waiting if rid not in failed]
    assert [finals[r].token_ids for r in survivors] == (reference * 2)[-len(survivors):]
    assert_clean_pool(eng)
    with pytest.raises(RuntimeError, match="top_k"):  # Engine.stream raises what failed the request
        list(eng.stream(prompts(1)[0], altered(SamplingParams(max_tokens=4), top_k=2**40)))
