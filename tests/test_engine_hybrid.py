"""The engine with a hybrid (interleaved local/global) model, a tiny random Gemma 3: windowed layers
hold a bounded ring of pages per slot (`jaxinfer.kv.window_ring`), global layers every page; greedy
outputs equal those of the unbounded cache through batching, chunking, preemption, the scanned
layout, n-gram speculation and int8 KV."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
from jaxinfer.server.metrics import ServerMetrics
from test_engine import prompts
from test_window_ring import GEMMA_TINY
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model() -> Model:
    config, params = tiny_model(max_position=512, **GEMMA_TINY)
    return Model(config=config, params=params, tokenizer=None)


def engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**({"max_slots": 4, "page_size": 4, "prefill_chunk": 8, "max_model_len": 128} | kw)))


def unbounded(model, prompt, params, **kw) -> list[int]:
    """One request alone in an engine whose ring would be as wide as a sequence: no ring."""
    eng = Engine(model, EngineConfig(**({"max_slots": 1, "page_size": 4, "prefill_chunk": 128, "max_model_len": 128} | kw)))
    assert eng.window_ring is None
    return eng.generate([prompt], params)[0].token_ids


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_windowed_layers_hold_a_ring_and_outputs_equal_the_unbounded_cache(model):
    ps = prompts(8, seed=5, lo=1, hi=40)
    sp = [greedy(int(n)) for n in np.random.default_rng(6).integers(20, 40, 8)]  # contexts up to 79: ~10 windows
    eng = engine(model)
    assert eng.window_ring == 5  # ceil((8 - 1 + 8) / 4) + 1
    pools = [jax.tree.leaves(layer)[0].shape[0] for layer in eng.kv.layers]
    assert pools == [21, 21, eng.spec.num_pages, 21]  # 4 slots x 5 ring pages + NULL_PAGE
    outs = eng.generate(ps, sp)
    for p, s, out in zip(ps, sp, outs):
        assert out.token_ids == unbounded(model, p, s)
    m = eng.metrics()
    assert (m.window_pages_total, m.window_pages_used) == (20, 0)
    eng.add_request(ps[0], greedy(5))
    eng.step()
    text = ServerMetrics().render(eng.metrics(), 0)  # the server's /metrics
    assert "jaxinfer_kv_window_pages_used 5\n" in text and "jaxinfer_kv_window_pages_total 20\n" in text


def test_preemption_and_scanned_layers_with_rings(model):
    ps = prompts(6, seed=7, lo=10, hi=30)
    want = [unbounded(model, p, greedy(12)) for p in ps]
    tight = engine(model, num_pages=14)
    assert [o.token_ids for o in tight.generate(ps, greedy(12))] == want
    assert tight.metrics().preemptions > 0
    scanned = engine(model, layer_loop="scan")
    assert [o.token_ids for o in scanned.generate(ps, greedy(12))] == want


@pytest.mark.extended
def test_ngram_speculation_and_int8_kv_with_rings(model):
    kv_cache = "int8"
    rng = np.random.default_rng(8)
    ps = [(rng.integers(0, 97, 6).tolist() * 5)[: int(n)] for n in rng.integers(12, 30, 3)]  # repetitive: drafts hit
    spec = SpeculativeConfig(method="ngram", num_speculative=4)
    eng = engine(model, kv_cache=kv_cache, speculative=spec)
    assert eng.window_ring == 5  # chunk 8 > 1 + 4 drafts
    outs = eng.generate(ps, greedy(24))
    for p, out in zip(ps, outs):
        assert out.token_ids == unbounded(model, p, greedy(24), kv_cache=kv_cache)
    assert eng.spec_stats.accepted.sum() > 0


def test_request_kv_bytes_are_bounded_for_windowed_layers(model):
    """Measured from the pools at 100 tokens: 3 windowed layers hold their 5-page ring, the global
    layer its 25 pages; the unbounded engine holds 25 pages in all 4."""
    c = model.config
    per_page = 2 * 4 * c.n_kv_heads * c.head_dim * 4  # K and V, 4 tokens, f32
    held = {}
    for name, eng in (("ring", engine(model)), ("full", engine(model, prefill_chunk=128))):
        rid = eng.add_request(list(range(90)), greedy(11))
        while len(eng.requests[rid].generated) < 10:
            eng.step()
        assert eng.requests[rid].num_computed == 99
        held[name] = eng.request_kv_bytes(rid)
    assert held == {"ring": (3 * 5 + 25) * per_page, "full": 4 * 25 * per_page}
