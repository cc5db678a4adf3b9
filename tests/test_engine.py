"""The serving engine: batching invariance, preemption, prefix caching, isolation, bad input."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.kv import KVCacheSpec, PageAllocator, init_paged_kv, partition_pages
from jaxinfer.kv.pages import NULL_PAGE
from jaxinfer.loading import Model
from jaxinfer.model import forward
from jaxinfer.sampling import MAX_LOGPROBS, SamplingParams
from jaxinfer.speculative import DraftModel
from tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> Model:
    config, params = tiny_model(max_position=512)
    return Model(config=config, params=params, tokenizer=None)


def engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**({"max_slots": 4, "page_size": 4, "prefill_chunk": 8, "max_model_len": 128} | kw)))


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 97, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def alone(model, prompt, params) -> list[int]:
    return Engine(model, EngineConfig(max_slots=1, page_size=4, prefill_chunk=128, max_model_len=128,
                                      enable_prefix_caching=False)).generate([prompt], params)[0].token_ids


def test_sixteen_concurrent_greedy_requests_equal_each_alone(model):
    ps = prompts(16, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in np.random.default_rng(2).integers(1, 20, 16)]
    eng = engine(model, max_slots=16, max_prefill_rows=2)
    outs = eng.generate(ps, params)
    for p, sp, out in zip(ps, params, outs):
        assert out.token_ids == alone(model, p, sp)
        assert len(out.token_ids) == sp.max_tokens and out.finish_reason == "length"


def test_seeded_sampling_is_independent_of_batching_and_chunking(model):
    ps = prompts(6, seed=3)
    sp = [SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=12, ignore_eos=True) for i in range(6)]
    together = engine(model, prefill_chunk=4).generate(ps, sp)
    for p, s, out in zip(ps, sp, together):
        assert out.token_ids == alone(model, p, s)


def test_preemption_under_a_tiny_pool_gives_the_same_outputs(model):
    ps = prompts(8, seed=4, lo=10, hi=30)
    sp = [GREEDY, SamplingParams(temperature=0.8, seed=9, max_tokens=10, ignore_eos=True)] * 4
    ample = engine(model).generate(ps, sp)
    tight = engine(model, num_pages=14)  # 13 usable pages of 4 tokens; one request needs up to 10
    outs = tight.generate(ps, sp)
    assert tight.metrics().preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]
    assert any(o.metrics.num_preemptions for o in outs)


def test_prefix_cache_reuses_shared_prefixes_and_changes_nothing(model):
    system = prompts(1, seed=5, lo=22, hi=23)[0]  # 22 tokens: 5 full pages of 4
    ps = [system + tail for tail in prompts(4, seed=6, lo=3, hi=9)]
    on, off = engine(model), engine(model, enable_prefix_caching=False)
    first = on.generate(ps[:1], GREEDY)  # fills the cache
    out_on = first + on.generate(ps[1:], GREEDY)
    out_off = off.generate(ps, GREEDY)
    assert [o.token_ids for o in out_on] == [o.token_ids for o in out_off]
    m = on.metrics()
    # Each later request finds the 5 full pages of the shared prefix; nothing else matches
    # (their first own page mixes prefix and random tail tokens).
    assert m.prefix_hits == 3 * 5
    assert [o.metrics.num_cached_prompt_tokens for o in out_on] == [0, 20, 20, 20]
    assert off.metrics().prefix_hits == 0


def test_a_request_waiting_for_pages_counts_its_prefix_lookup_once(model):
    """The head of the queue looks its prefix up at every step until pages free; the cache's
    counters count one lookup per admission (they would follow the wait, not the reuse)."""
    system = prompts(1, seed=5, lo=22, hi=23)[0]  # 5 full pages of 4
    eng = engine(model, num_pages=14, max_slots=2)  # 13 usable pages
    eng.generate([system + [1]], GREEDY)  # caches the 5 pages
    before = eng.metrics()
    eng.add_request(prompts(1, seed=8, lo=30, hi=31)[0], SamplingParams(temperature=0, max_tokens=18, ignore_eos=True))
    eng.step()  # the hog takes most of the pool ...
    eng.add_request(system + [2, 3], GREEDY)  # ... so this one waits several steps for pages
    done, steps = {}, 1
    while eng.has_unfinished_requests():
        done |= {o.request_id: o for o in eng.step() if o.finished}
        steps += 1
    m = eng.metrics()
    # one lookup of its full prompt pages per admission (a preempted request is admitted again)
    want = sum(((len(o.prompt_token_ids) - 1) // 4) * (1 + o.metrics.num_preemptions) for o in done.values())
    assert steps > 5 and m.prefix_queries - before.prefix_queries == want < 40
    assert m.prefix_hits - before.prefix_hits >= 5


def test_different_salts_never_share_pages(model):
    p = prompts(1, seed=7, lo=30, hi=31)[0]
    eng = engine(model)
    a = eng.generate([p], GREEDY)[0]
    rid = eng.add_request(p, GREEDY, cache_salt="tenant-b")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert eng.metrics().prefix_hits == 0
    assert outs[-1].token_ids == a.token_ids and outs[-1].request_id == rid
    eng.add_request(p, GREEDY, cache_salt="tenant-b")  # same tenant again: hits
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.metrics().prefix_hits == (len(p) - 1) // 4


def test_bad_input_raises_at_add_request_and_serving_continues(model):
    eng = engine(model)
    rid = eng.add_request(prompts(1)[0], GREEDY, request_id="ok")
    eng.step()
    cases = [
        (dict(prompt=[]), "empty"),
        (dict(prompt=[1, 2, 500]), "outside the vocabulary"),
        (dict(prompt=[1] * 129), "leaves no room"),
        (dict(prompt="text"), "no tokenizer"),
        (dict(prompt=3.5), "prompt must be"),
        (dict(prompt=[1, 2], request_id="ok"), "already in use"),
        (dict(prompt=[1, 2], params="greedy"), "SamplingParams"),
        (dict(prompt=[1, 2], cache_salt=7), "cache_salt"),
        (dict(prompt=[1, 2], params=SamplingParams(stop_token_ids=(3, 500))), r"stop_token_ids: token ids \[500\]"),
        (dict(prompt=[1] * 128, params=SamplingParams(max_tokens=None)), "leaves no room"),
    ]
    for kwargs, message in cases:
        kwargs.setdefault("params", GREEDY)
        with pytest.raises(ValueError, match=message):
            eng.add_request(**kwargs)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].request_id == rid and outs[-1].finished and len(outs[-1].token_ids) == 10
    assert eng.scheduler.allocator.num_allocated == 0


def test_a_pool_smaller_than_the_context_cuts_max_model_len(model, caplog):
    """3 usable pages of 4 hold 12 tokens of one request: max_model_len is cut to 12, with a
    warning naming both (vLLM refuses to start), so requests are capped as at the context."""
    with caplog.at_level("WARNING"):
        small = engine(model, num_pages=4)
    assert small.max_model_len == 12 and "max_model_len is cut to 12" in caplog.text
    with pytest.raises(ValueError, match="leaves no room"):
        small.add_request([1] * 12, GREEDY)
    out = small.generate([[1] * 10], GREEDY)[0]
    assert (len(out.token_ids), out.finish_reason) == (2, "length")


def test_invalid_engine_config_is_rejected(model):
    with pytest.raises(ValueError, match="max_slots"):
        EngineConfig(max_slots=0)
    with pytest.raises(ValueError, match="scheduling"):
        EngineConfig(scheduling="fifo")
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model, EngineConfig(max_model_len=10_000))


def test_max_tokens_beyond_the_context_ends_at_the_context(model):
    """As in vLLM's engine, a request whose max_tokens (and min_tokens) reach past max_model_len
    runs until the context is full and finishes "length"; the prompt alone must leave room."""
    eng = engine(model)
    room = eng.max_model_len - 120
    params = SamplingParams(temperature=0, max_tokens=50, min_tokens=20, ignore_eos=True)
    out = eng.generate([prompts(1, seed=3, lo=120, hi=121)[0]], params)[0]
    assert len(out.token_ids) == room and out.finish_reason == "length"


def test_abort_mid_generation_frees_pages(model):
    eng = engine(model)
    a = eng.add_request(prompts(1, seed=8, lo=20, hi=21)[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    b = eng.add_request(prompts(1, seed=9)[0], GREEDY)
    for _ in range(6):
        eng.step()
    assert eng.scheduler.allocator.num_allocated > 0
    assert eng.abort(a) is True
    while eng.has_unfinished_requests():
        eng.step()
    assert b not in eng.requests
    assert eng.scheduler.allocator.num_allocated == 0
    eng.scheduler.allocator.check_invariants()
    assert eng.abort(a) is eng.abort(b) is eng.abort("never-added") is False  # finished or unknown: nothing to stop


def test_request_timestamps_follow_the_request(model):
    """arrival <= first scheduled <= first token <= last token <= finished; with one slot the
    second request is first scheduled only after the first one finished (it queued)."""
    eng = engine(model, max_slots=1)
    first, second = eng.generate(prompts(2, seed=3), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for out in (first, second):
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
    assert second.metrics.first_scheduled_time >= first.metrics.finished_time


def test_max_tokens_none_generates_to_the_end_of_the_context(model):
    """vLLM's max_tokens=None: as many tokens as max_model_len leaves after the prompt."""
    out = engine(model, max_model_len=48).generate([[5] * 20], SamplingParams(temperature=0, max_tokens=None,
                                                                             ignore_eos=True))[0]
    assert len(out.token_ids) == 28 and out.finish_reason == "length"


def test_generate_takes_one_prompt_alone(model):
    """A prompt given alone (token ids as a list or an array) is a batch of one."""
    ids, params = prompts(1, seed=4)[0], SamplingParams(temperature=0, max_tokens=5)
    want = engine(model).generate([ids], params)[0].token_ids
    eng = engine(model)
    assert [o.token_ids for o in eng.generate(ids, params)] == [want]
    assert [o.token_ids for o in eng.generate(np.asarray(ids), params)] == [want]
    for bad in ([], np.zeros((2, 3), np.int32), 7):
        with pytest.raises(ValueError, match="prompts must be"):
            eng.generate(bad, params)


def test_two_hundred_requests_compile_nothing_after_warmup(model):
    eng = engine(model, max_slots=8, max_prefill_rows=2, prefill_chunk=8)
    # per context bucket: decode+prefill, and decode-only at each row bucket (by default 1 and 8)
    assert eng.decode_row_buckets == [1, 8]
    assert eng.warmup() == 3 * len(eng.context_buckets)
    before = eng.metrics().obtained_programs
    rng = np.random.default_rng(11)
    ps = prompts(200, seed=12, hi=60)
    sp = [SamplingParams(temperature=float(rng.choice([0, 0.7])), top_p=0.9, seed=i, max_tokens=int(rng.integers(1, 12)))
          for i in range(200)]
    outs = eng.generate(ps, sp)
    assert all(o.finished for o in outs)
    assert eng.metrics().obtained_programs == before


def test_decode_rows_shrink_to_the_requests_decoding_and_change_no_token(model):
    """A decode-only step runs the smallest row bucket that holds its decoding requests
    (packed first, in any slots), and every token and logprob is what the engine gives with
    all max_slots rows every step."""
    ps = prompts(11, seed=21, hi=9)  # one prefill chunk each: decode-only steps come soon
    # slots 1 and 3 decode last: rows 0-1 then hold them, and idle rows 2-3 point at slots 2-3
    lengths = [3, 30, 5, 36, 2, 4, 3, 6, 2, 8, 5]
    sp = [SamplingParams(temperature=[0, 0.8][i % 2], top_p=[1.0, 0.9][i % 3 > 0], seed=i, ignore_eos=True,
                         max_tokens=n, logprobs=2 if i % 4 == 0 else None) for i, n in enumerate(lengths)]
    full = engine(model, max_slots=8, decode_row_buckets=(8,))
    assert full.decode_row_buckets == [8]
    expected = full.generate(ps, sp)
    eng = engine(model, max_slots=8, decode_row_buckets=(1, 4))
    assert eng.decode_row_buckets == [1, 4, 8]
    dispatched = record_dispatches(eng)
    outs = eng.generate(ps, sp)
    assert_same_outputs(outs, expected)
    steps = [(batch.prefill is not None, len(batch.decode_active), int(batch.decode_active.sum()))
             for batch, _ in dispatched]
    # an idle row points at a slot an active row decodes
    shared = [any(n <= slot < rows for slot in batch.decode_slots[:n])
              for (batch, _), (_, rows, n) in zip(dispatched, steps)]
    decode_only = [(rows, n) for prefill, rows, n in steps if not prefill]
    assert {rows for rows, _ in decode_only} == {1, 4, 8}
    assert all(rows == min(r for r in (1, 4, 8) if r >= n) for rows, n in decode_only)
    assert all(rows == 8 for prefill, rows, _ in steps if prefill)
    assert any(shared)  # so idle rows must not return tokens for their slot
    assert eng.metrics().obtained_programs <= len(eng.program_keys()) + 1  # + the block-table update


def record_dispatches(eng: Engine) -> list[tuple]:
    """(batch, drafts) of every step `eng` dispatches from now on."""
    steps, dispatch = [], eng._dispatch

    def record(i, batch, drafts, *rest):
        steps.append((batch, drafts))
        return dispatch(i, batch, drafts, *rest)

    eng._dispatch = record
    return steps


def assert_same_outputs(outs, expected) -> None:
    """Tokens equal, logprobs within 1e-5 and the same top alternatives, request by request."""
    for out, ref in zip(outs, expected, strict=True):
        assert out.token_ids == ref.token_ids
        if ref.logprobs is not None:
            np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=0, atol=1e-5)
            assert [[t for t, _ in top] for top in out.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]


def test_decode_row_buckets_are_validated_and_kept_full_where_rows_are_slots(model):
    for bad in [(0,), (9,), [1, 8], (), (1.5,)]:
        with pytest.raises(ValueError, match="decode_row_buckets"):
            EngineConfig(max_slots=8, decode_row_buckets=bad)
    assert engine(model, max_slots=8, decode_row_buckets=(2,)).decode_row_buckets == [2, 8]
    defaults = {slots: engine(model, max_slots=slots).decode_row_buckets for slots in (1, 3, 8, 16, 32, 64)}
    assert defaults == {1: [1], 3: [1, 3], 8: [1, 8], 16: [1, 4, 16], 32: [1, 4, 32], 64: [1, 4, 16, 64]}
    # static batches keep their rows, as transformers' generate does, unless told otherwise
    assert engine(model, max_slots=8, scheduling="static").decode_row_buckets == [8]
    assert engine(model, max_slots=8, scheduling="static", decode_row_buckets=(1,)).decode_row_buckets == [1, 8]
    # speculative steps pack their verify blocks by row too (`test_speculative_engine`)
    assert engine(model, max_slots=8, speculative=SpeculativeConfig("ngram", 2)).decode_row_buckets == [1, 8]


def test_each_engine_counts_only_its_own_programs(model):
    """Two engines of different shapes in one process: each reports its own programs (per
    context bucket: decode+prefill and decode-only per row bucket; and the block-table update), unchanged by the other's traffic and by steady-state steps; a third
    with the first one's shapes compiles nothing (it reuses the executables)."""
    small = engine(model, max_slots=2, max_model_len=32, min_context_bucket=8)  # buckets of 2, 8 pages
    large = engine(model, max_slots=4, max_model_len=64, min_context_bucket=8)  # 2, 8, 16 pages
    assert len(small.context_buckets) != len(large.context_buckets)
    for eng in (small, large):
        eng.warmup()
    counts = [eng.metrics().obtained_programs for eng in (small, large)]
    # + 1: the block-table update (`kv.table_updates`)
    assert counts == [(1 + len(e.decode_row_buckets)) * len(e.context_buckets) + 1 for e in (small, large)]
    sp = SamplingParams(temperature=0.7, seed=1, max_tokens=8)
    for eng in (small, large, small):
        eng.generate(prompts(6, seed=5, hi=20), sp)
    assert [eng.metrics().obtained_programs for eng in (small, large)] == counts
    twin = engine(model, max_slots=2, max_model_len=32, min_context_bucket=8)  # same shapes: reuses small's executables
    twin.warmup()
    twin.generate(prompts(6, seed=5, hi=20), sp)
    assert twin.metrics().obtained_programs == 0
    assert [eng.metrics().obtained_programs for eng in (small, large)] == counts


# ---- property test: random traffic never breaks page ownership ---------------------------------

actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.sampled_from([None, "a", "b"])),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=25,
)


def split_into_replicas(eng: Engine, parts: int) -> Engine:
    """Give the host scheduler `parts` data replicas (as a data=parts mesh would) on one
    device: page ids stay global, so the device side runs unchanged and this checks the
    host's per-replica bookkeeping alone (tests/test_multi_device.py runs it on a mesh)."""
    s, n = eng.scheduler, eng.spec.num_pages
    s.slots_per_replica = s.max_slots // parts
    s.allocators = [PageAllocator(n, r) for r in partition_pages(n, parts)]
    s.prefill_rows_per_replica = -(-s.max_prefill_rows // parts)
    s.max_prefill_rows = s.prefill_rows_per_replica * parts
    return eng


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(script=actions, shared=st.booleans(), replicas=st.sampled_from([1, 2]))
def test_random_traffic_keeps_pages_consistent(model, script, shared, replicas):
    # every request fits a replica (<= 8 + 30 + 12 = 50 tokens: 13 pages; replica 0 of 28 holds
    # 13, NULL_PAGE given up); two per replica do not always
    eng = split_into_replicas(engine(model, num_pages=24 if replicas == 1 else 28), replicas)
    base = prompts(1, seed=13, lo=12, hi=13)[0]
    rng = np.random.default_rng(0)
    live: list[str] = []
    for action in script:
        if action[0] == "add":
            _, n, max_tokens, salt = action
            p = (base[:8] if shared else []) + rng.integers(0, 97, n).tolist()
            live.append(eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens), cache_salt=salt))
        elif action[0] == "step":
            for _ in range(action[1]):
                eng.step()
        elif live:
            rid = live.pop(action[1] % len(live))
            if rid in eng.requests:
                eng.abort(rid)
        check_ownership(eng)
    while eng.has_unfinished_requests():
        eng.step()
        check_ownership(eng)
    s = eng.scheduler
    assert s.num_allocated == 0 and s.num_free == eng.spec.num_pages - 1


def check_ownership(eng: Engine) -> None:
    s = eng.scheduler
    for alloc in s.allocators:
        alloc.check_invariants()
    owners: dict[int, list] = {}
    for req in s.running:
        assert NULL_PAGE not in req.pages
        assert all(page in s.allocators[s.replica_of(req.slot)].pages for page in req.pages), "page of another replica"
        for page in req.pages:
            owners.setdefault(page, []).append(req)
    for page, reqs in owners.items():
        alloc = s.allocators[s.replica_of(reqs[0].slot)]
        assert alloc.refcount(page) == len(reqs)
        if len(reqs) > 1:
            # Shared only as a cached prefix page, by requests of one salt, at one block index.
            assert page in alloc._hash_of
            assert len({r.cache_salt for r in reqs}) == 1
            assert len({r.pages.index(page) for r in reqs}) == 1


def test_data_parallel_replicas_preempt_within_themselves_and_change_nothing(model):
    """Two replicas of 2 slots and 7-8 pages each, 8 requests: pages run out inside a replica,
    whose own latest request is preempted; tokens equal the unsplit engine's."""
    ps = prompts(8, seed=21, lo=6, hi=14)
    want = [o.token_ids for o in engine(model).generate(ps, GREEDY)]
    eng = split_into_replicas(engine(model, num_pages=16), 2)
    outs = eng.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert eng.scheduler.stats.preemptions > 0


def test_each_replica_prefills_its_own_requests_in_its_own_row_block():
    """max_prefill_rows=3 over 2 replicas: 2 rows each, 4 in the batch; replica r's chunks go
    to rows [2r, 2r + 2), as many as it has (up to 2) whatever the other replica has."""
    s = Scheduler(max_slots=6, page_size=4, num_pages=40, prefill_chunk=8, max_prefill_rows=3,
                  max_tokens_per_step=None, enable_prefix_caching=False, cache_root=b"", data_parallel=2)
    assert (s.prefill_rows_per_replica, s.max_prefill_rows, s.max_tokens_per_step) == (2, 4, 6 + 4 * 8)
    for i, ids in enumerate(prompts(5, seed=24, lo=10, hi=20)):
        s.add(Request(f"r{i}", ids, GREEDY, 0, (), None, None))
    plan = s.schedule()
    replicas = [s.replica_of(r.slot) for r, _ in plan.prefill]
    assert sorted(replicas) == [0, 0, 1, 1]  # 3 and 2 admitted per replica; 2 rows each
    assert sorted(plan.prefill_rows) == [0, 1, 2, 3]
    assert all(row // 2 == replica for row, replica in zip(plan.prefill_rows, replicas))


def test_a_new_request_goes_to_the_replica_caching_its_prefix(model):
    """One replica is busy, so the first system-prompt request lands on the other; once all
    is idle, the second goes where its prefix is cached, although the other replica has more
    free pages (replica 0 gives up page 0)."""
    system = prompts(1, seed=22, lo=16, hi=17)[0]
    eng = split_into_replicas(engine(model, num_pages=128), 2)
    s = eng.scheduler
    busy = eng.add_request(prompts(1, seed=23, lo=20, hi=21)[0], GREEDY)
    eng.step()
    first = eng.add_request(system + [5, 6], GREEDY)
    eng.step()
    replica = s.replica_of(eng.requests[first].slot)
    assert replica != s.replica_of(eng.requests[busy].slot)
    while eng.has_unfinished_requests():
        eng.step()
    assert [a.num_free for a in s.allocators] == [63, 64]
    second = eng.add_request(system + [7, 8, 9], GREEDY)
    eng.step()
    req = eng.requests[second]
    assert s.replica_of(req.slot) == replica == 0 and req.metrics.num_cached_prompt_tokens == 16


def test_requests_admitted_together_pick_up_a_prefix_cached_meanwhile(model):
    """All four miss at admission; the first to prefill the shared 24 tokens caches 6 pages,
    and the other three take them instead of recomputing (one prefill row per step)."""
    system = prompts(1, seed=14, lo=24, hi=25)[0]
    ps = [system + tail for tail in prompts(4, seed=15, lo=2, hi=6)]
    eng = engine(model, max_prefill_rows=1)
    outs = eng.generate(ps, GREEDY)
    assert sorted(o.metrics.num_cached_prompt_tokens for o in outs) == [0, 24, 24, 24]
    off = engine(model, enable_prefix_caching=False).generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]


def test_quantized_kv_cache_through_the_engine(model):
    """EngineConfig(kv_cache=...) stores the cache in the named format; bad names raise."""
    ps = prompts(3, seed=16, lo=10, hi=30)
    full = [o.token_ids for o in engine(model).generate(ps, GREEDY)]
    int8 = engine(model, kv_cache="int8")
    assert int8.kv.layers[0].__class__.__name__ != "LayerKV"
    got = [o.token_ids for o in int8.generate(ps, GREEDY)]
    agree = np.mean([a == b for x, y in zip(full, got) for a, b in zip(x, y)])
    assert agree >= 0.9, agree  # int8 error is below half a step per element
    with pytest.raises(ValueError, match="int7"):
        engine(model, kv_cache="int7")


# ---- logprobs ------------------------------------------------------------------------------------


def reference_logprobs(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """log_softmax (float64, numpy) of the raw logits before each generated token, from one
    `forward` over the whole sequence: f64[len(generated), V]."""
    seq = np.asarray([prompt + generated[:-1]], np.int32)
    spec = KVCacheSpec.for_batch(1, seq.shape[1], page_size=8)
    kv = init_paged_kv(model.config, spec)
    kv = kv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32).reshape(1, -1))
    logits, _ = forward(model.params, model.config, jnp.asarray(seq), jnp.arange(seq.shape[1])[None], kv)
    x = np.asarray(logits[0, len(prompt) - 1 :], np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_logprobs(model, prompt, out, n: int) -> None:
    """Each token's logprob and its top n equal the reference within 1e-5; top n sorted, argmax first."""
    ref = reference_logprobs(model, prompt, out.token_ids)
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(len(ref)), out.token_ids], rtol=0, atol=1e-5)
    for row, top in zip(ref, out.top_logprobs):
        ids, values = [i for i, _ in top], [v for _, v in top]
        assert len(top) == n and values == sorted(values, reverse=True)
        if n:
            assert ids[0] == int(np.argmax(row))
        np.testing.assert_allclose(values, np.sort(row)[::-1][:n], rtol=0, atol=1e-5)
        np.testing.assert_allclose(values, row[ids], rtol=0, atol=1e-5)


LOGPROB_PROMPTS = [prompts(1, seed=17, lo=13, hi=14)[0], prompts(1, seed=18, lo=21, hi=22)[0]]  # chunks 8 + 5, 8 + 8 + 5
LOGPROB_PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=MAX_LOGPROBS),
                  SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=12, ignore_eos=True, logprobs=2)]


def test_logprobs_are_log_softmax_of_the_raw_logits(model):
    """Greedy and sampled (temperature/top-k do not change the reported numbers), the first
    token from a prefill row and the rest from decode; requests that did not ask get None."""
    eng = engine(model)
    outs = eng.generate(LOGPROB_PROMPTS + [LOGPROB_PROMPTS[0]], LOGPROB_PARAMS + [GREEDY])
    for prompt, sp, out in zip(LOGPROB_PROMPTS, LOGPROB_PARAMS, outs):
        check_logprobs(model, prompt, out, sp.logprobs)
    assert outs[2].logprobs is None and outs[2].top_logprobs is None
    zero = eng.generate(LOGPROB_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, logprobs=0))[0]
    assert zero.top_logprobs == [[]] * 3
    np.testing.assert_allclose(zero.logprobs, outs[0].logprobs[:3], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=True)


def test_prompt_logprobs_score_the_prompt_as_decoding_scored_it(model):
    """vLLM's `prompt_logprobs`: prompt token i gets the logprob the model gives it after tokens
    0..i-1 (the first gets None), so a greedy output fed back as a prompt is scored as decoding
    scored it (logprobs and alternatives); with output_kind "delta" they come once, first."""
    eng, prompt = engine(model), LOGPROB_PROMPTS[1]
    [first] = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    fed = prompt + first.token_ids
    [again] = eng.generate([fed], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    assert again.logprobs is None and len(again.prompt_logprobs) == len(again.prompt_top_logprobs) == len(fed)
    assert again.prompt_logprobs[0] is None and again.prompt_top_logprobs[0] is None
    np.testing.assert_allclose(again.prompt_logprobs[len(prompt):], first.logprobs, rtol=0, atol=1e-4)
    for got, want in zip(again.prompt_top_logprobs[len(prompt):], first.top_logprobs):
        assert [i for i, _ in got] == [i for i, _ in want]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=0, atol=1e-4)

    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, output_kind="delta"))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    assert len(outs) > 1 and all(o.prompt_logprobs is None and o.prompt_top_logprobs is None for o in outs[1:])
    np.testing.assert_allclose(outs[0].prompt_logprobs[1:], again.prompt_logprobs[1 : len(prompt)], rtol=0, atol=1e-5)
    assert outs[0].prompt_top_logprobs[1:] == [[]] * (len(prompt) - 1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", 3, ngram_max=2, ngram_min=1)])
def test_the_logprob_program_runs_only_for_steps_that_emit_to_a_request_asking(model, monkeypatch, speculative):
    """Steps return logits, and the logprob program runs apart only when an emitted token's
    request asked: one request of three asks, and its numbers are exact; once it is done
    (or when none ever asked), steps run no logprob program."""
    import jaxinfer.engine.engine as engine_module

    calls = []
    real = engine_module.step_logprobs
    monkeypatch.setattr(engine_module, "step_logprobs", lambda *a: calls.append(a[0].shape) or real(*a))
    eng = engine(model, speculative=speculative)
    eng.generate(prompts(3, seed=5), GREEDY)
    assert calls == []
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    ps = LOGPROB_PROMPTS + [prompts(1, seed=6, lo=5, hi=6)[0]]
    outs = eng.generate(ps, [dataclasses.replace(GREEDY, max_tokens=20), GREEDY, short])
    check_logprobs(model, ps[2], outs[2], 2)
    assert outs[0].logprobs is None and outs[1].logprobs is None
    asked = len(calls)
    assert 0 < asked < eng.metrics().steps
    eng.generate(prompts(2, seed=7), GREEDY)
    assert len(calls) == asked
    assert outs[2].token_ids == alone(model, ps[2], short)


@pytest.mark.parametrize("source", ["draft", "ngram"])
def test_speculative_logprobs_equal_plain_ones(model, source):
    """Each emitted token of a verified block reports the same logprob as plain decoding: a
    draft equal to the target accepts every draft (accepted drafts get their own); n-gram
    drafts here are proposed and rejected, mixing verify blocks and the plain program."""
    sc = {"draft": SpeculativeConfig("draft", 3, draft=DraftModel(model.config, model.params)),
          "ngram": SpeculativeConfig("ngram", 3, ngram_max=2, ngram_min=1)}[source]
    spec = engine(model, speculative=sc)
    outs = spec.generate(LOGPROB_PROMPTS, LOGPROB_PARAMS)
    stats = spec.metrics().speculative
    assert (stats.accepted if source == "draft" else stats.drafted).sum() > 0
    for prompt, sp, out in zip(LOGPROB_PROMPTS, LOGPROB_PARAMS, outs):
        check_logprobs(model, prompt, out, sp.logprobs)
    plain = engine(model).generate(LOGPROB_PROMPTS[:1], LOGPROB_PARAMS[:1])[0]
    assert outs[0].token_ids == plain.token_ids
    np.testing.assert_allclose(outs[0].logprobs, plain.logprobs, rtol=0, atol=1e-5)
    assert [[i for i, _ in top] for top in outs[0].top_logprobs] == [[i for i, _ in top] for top in plain.top_logprobs]
