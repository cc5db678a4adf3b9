"""Prefix caching with a hybrid model whose windowed layers hold rings (`jaxinfer.kv.window_ring`):
a hit's global layers read the shared pages, and the request recomputes the last
`hit_recompute` tokens before the hit's end (rounded to pages) so its rings receive exact keys,
with the global layers' writes into the shared pages dropped. Greedy tokens and logprobs with
prefix caching equal those without, for shared prefixes shorter than, equal to and longer than
the window, requests sharing a prefix at once, after the first finished, and arriving while it
prefills."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig, RequestOutput
from jaxinfer.kv.window_ring import hit_recompute
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
from test_window_ring import GEMMA_TINY, GPT_OSS_TINY
from tiny_models import tiny_model

PAGE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
# model -> (its window, tokens recomputed before a hit's end: the sum of W - 1 over windowed layers)
MODELS = {"gemma3": (GEMMA_TINY, 8, 3 * 7), "gpt_oss": (GPT_OSS_TINY, 6, 2 * 5)}


def engine(model: Model, prefix_caching: bool, **options) -> Engine:
    return Engine(model, EngineConfig(max_slots=4, page_size=PAGE, prefill_chunk=8, max_model_len=128,
                                      enable_prefix_caching=prefix_caching, **options))


def run(eng: Engine, rounds: list[list[list[int]]], staggered: list[list[int]]) -> list[RequestOutput]:
    """Each round's prompts together (a round starts once the last finished); then the staggered
    prompts, each added 3 steps after the one before (it arrives while that one prefills)."""
    outs = []
    for prompts in rounds:
        outs += eng.generate(prompts, GREEDY)
    done: dict[str, RequestOutput] = {}
    ids = []
    for prompt in staggered:
        ids.append(eng.add_request(prompt, GREEDY))
        for _ in range(3):
            done |= {o.request_id: o for o in eng.step() if o.finished}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    return outs + [done[i] for i in ids]


@pytest.mark.parametrize("name", list(MODELS))
def test_prefix_hits_with_rings_equal_no_prefix_caching(name):
    fields, window, recompute = MODELS[name]
    config, params = tiny_model(max_position=512, **fields)
    model = Model(config=config, params=params, tokenizer=None)
    rng = np.random.default_rng(2)
    tokens = lambda n: rng.integers(0, 97, n).tolist()  # noqa: E731
    prefixes = [tokens(window - 2), tokens(window), tokens(44)]  # shorter than, equal to, longer than the window
    first = [p + tokens(3) for p in prefixes]
    second = [p + tokens(int(n)) for p in prefixes for n in rng.integers(2, 9, 2)]  # two per prefix, at once
    long = tokens(60)
    staggered = [long + tokens(5), long + tokens(4)]  # the second hits the first's pages mid-prefill

    # all 4 decode rows every step: which row buckets traffic reaches (and so which programs,
    # logprob ones included) depends on how many prefill steps the hits save
    reference = engine(model, False, decode_row_buckets=(4,))
    want = run(reference, [first, second], staggered)
    eng = engine(model, True, decode_row_buckets=(4,))
    got = run(eng, [first, second], staggered)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)
    assert eng.window_ring is not None and eng.scheduler.hit_recompute == recompute
    assert hit_recompute([config.window(i) for i in range(config.n_layers)]) == recompute

    # The hits are real: each second-round request shares its prefix's full pages (H tokens) and
    # skips all but the last `recompute` of them, rounded down to a page: 44 tokens -> H = 44,
    # 20 tokens saved (gemma3) or 32 (gpt_oss); the short prefixes share pages but save nothing.
    saved = [o.metrics.num_cached_prompt_tokens for o in got[len(first):len(first) + len(second)]]
    hits = [len(p) // PAGE * PAGE for p in prefixes for _ in range(2)]
    assert saved == [max(h - recompute, 0) // PAGE * PAGE for h in hits]
    assert saved[-1] == {"gemma3": 20, "gpt_oss": 32}[name]
    assert got[-1].metrics.num_cached_prompt_tokens > 0  # the staggered request's hit saved tokens too
    m = eng.metrics()
    assert m.prefix_hits >= sum(hits) // PAGE
    # no new programs: the reference engine (same shapes, run first) compiled every one this one ran
    assert reference.metrics().obtained_programs > 0 and m.obtained_programs == 0


def test_kivi_formats_keep_prefix_caching_off_with_rings():
    """KIVI pages are written whole from a slot's tail, not through the write indices, so the
    recomputed tokens of a hit would rewrite shared pages: no prefix caching with rings there."""
    config, params = tiny_model(max_position=512, **GEMMA_TINY)
    model = Model(config=config, params=params, tokenizer=None)
    assert not engine(model, True, kv_cache="int4").scheduler.enable_prefix_caching
    assert engine(model, True, kv_cache="int8").scheduler.enable_prefix_caching
