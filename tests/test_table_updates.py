"""Device-resident block tables (`jaxinfer.kv.table_updates`): after every step the device's
tables equal the tables the host used to build in full each step (`host_tables`, the old
`Engine._batch` logic kept here as the oracle), through admission, chunked prefill, page
growth, preemption, abort, prefix hits, pages released behind a window, finishing requests
and slot reuse, with plain, asynchronous and speculative steps."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.kv.pages import NULL_PAGE
from jaxinfer.kv.table_updates import TableMirror, apply_table_updates
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model() -> Model:
    """Every layer windowed: pages behind the window are released (their entries nulled) as
    requests advance."""
    config, params = tiny_model(max_position=512, layer_windows=(8, 8))
    return Model(config=config, params=params, tokenizer=None)


def host_tables(eng: Engine) -> np.ndarray:
    """i32[max_slots, max_pages_per_seq]: every running request's pages in its slot's row,
    NULL_PAGE elsewhere (what `_batch` sent each step before the tables moved to the device)."""
    tables = np.full((eng.spec.max_slots, eng.spec.max_pages_per_seq), NULL_PAGE, np.int32)
    for req in eng.scheduler.running:
        tables[req.slot, : len(req.pages)] = req.pages
    return tables


def checked(eng: Engine) -> dict[str, list[int]]:
    """Make `eng` compare its device tables with `host_tables` at every step it dispatches;
    returns lists it fills per step: "mismatched" (steps whose tables differ: recorded, since
    the engine would contain an exception raised here as a failed request), "triples" (update
    entries sent), "released" (running requests holding pages released behind the window)."""
    dispatch, sent = eng._dispatch, {"mismatched": [], "triples": [], "released": []}

    def dispatch_and_check(index, batch, drafts, feed, updates, *rest):
        expected = host_tables(eng)  # the scheduler's pages at launch, as `_batch` read them
        out = dispatch(index, batch, drafts, feed, updates, *rest)
        if not np.array_equal(np.asarray(eng.kv.block_tables), expected):
            sent["mismatched"].append(index)
        assert batch.width >= max(len(r.pages) for r in eng.scheduler.running)
        sent["triples"].append(sum(int((u.slots < eng.spec.max_slots).sum()) for u in updates))
        sent["released"] += [r.slot for r in eng.scheduler.running if r.pages and r.pages[0] == NULL_PAGE]
        return out

    eng._dispatch = dispatch_and_check
    return sent


def trace(eng: Engine, seed: int, temperature: float) -> dict[str, list[int]]:
    """Requests sharing prefixes, arriving over time, one aborted mid-way, under a pool small
    enough to preempt; -> the finished requests' tokens by id."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 97, 12).tolist()
    prompts = [shared + rng.integers(0, 97, int(n)).tolist() for n in rng.integers(1, 20, 9)]
    prompts += [rng.integers(0, 97, int(n)).tolist() for n in rng.integers(2, 30, 3)]
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=14, ignore_eos=True)
    done, ids = {}, []
    for i, prompt in enumerate(prompts):
        ids.append(eng.add_request(prompt, params))
        if i == 6:
            eng.abort(ids[2])
        for _ in range(2):
            done |= {o.request_id: o.token_ids for o in eng.step() if o.finished}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o.token_ids for o in eng.step() if o.finished}
    return done


def config(**changes) -> EngineConfig:
    """One context bucket (the whole table): fewer programs to compile."""
    return EngineConfig(**(dict(max_slots=4, page_size=4, prefill_chunk=8, max_model_len=64, num_pages=10,
                                min_context_bucket=64) | changes))


# seeded sampling repeats exactly whatever the batching; speculative sampling only greedily (how
# many drafts a row verifies depends on the step's budget, and so do the random draws)
@pytest.mark.parametrize("options, temperature", [({}, 0.7), ({"async_scheduling": True}, 0.7),
                                                  ({"speculative": SpeculativeConfig("self", 2, self_layers=1)}, 0)],
                         ids=["plain", "async", "speculative"])
def test_device_tables_equal_the_host_built_tables_after_every_step(model, options, temperature):
    eng = Engine(model, config(**options))
    sent = checked(eng)
    done = trace(eng, 1, temperature)
    assert sent["mismatched"] == []
    m = eng.metrics()
    assert m.preemptions > 0 and m.prefix_hits > 0 and len(done) == 11  # the trace reached every case
    assert sent["released"]  # and pages behind the window
    assert 0 < max(sent["triples"]) and min(sent["triples"]) == 0  # steps with and without changes
    # the same traffic without the prefix cache gives the same tokens (same shapes: nothing to compile)
    reference = Engine(model, config(enable_prefix_caching=False, **options))
    assert trace(reference, 1, temperature) == done


def test_mirror_updates_rebuild_any_sequence_of_rows_in_chunks():
    """Random rows (growing, shrinking, freed, refilled) through updates of 5 triples (so most
    changes span several updates) applied on the device equal the rows themselves."""
    rng = np.random.default_rng(0)
    slots, width = 6, 9
    mirror = TableMirror(slots, width, size=5)
    device = np.full((slots, width), NULL_PAGE, np.int32)
    expected = device.copy()
    for _ in range(40):
        rows = []
        for slot in rng.choice(slots, int(rng.integers(0, 4)), replace=False):
            pages = rng.integers(1, 50, int(rng.integers(0, width + 1))).tolist()
            rows.append((int(slot), pages))
            expected[slot] = NULL_PAGE
            expected[slot, : len(pages)] = pages
        for update in mirror.updates(rows):
            device = np.asarray(apply_table_updates(device, update))
        np.testing.assert_array_equal(device, expected)
