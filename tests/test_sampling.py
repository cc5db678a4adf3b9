"""Sampling: validation, allowed sets of top-k/top-p/min-p, the sampled distribution, seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.sampling import (FAST_TOP_K, INT32_MAX, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE, SamplingArrays,
                               SamplingParams, filter_logits, greedy_tokens, sample_tokens)


def arrays(n=1, **kw) -> SamplingArrays:
    return SamplingArrays.from_params([SamplingParams(**kw)] * n, list(range(n)))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -3}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        # values that once passed and then overflowed the step's fixed-width arrays
        ({"top_k": 2**31}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"stop_token_ids": (2**31,)}, "stop_token_ids"),
        ({"seed": 2**32}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"top_k": True}, "top_k"),
        ({"stop": ("x",) * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop_token_ids": (1,) * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"speculative": 1}, "speculative"),
    ],
)
def test_invalid_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_vllm_conventions_for_off_and_open_ended():
    """top_k=-1 is "off" (stored as 0); max_tokens=None leaves the length to the context."""
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=-1) == SamplingParams()
    assert SamplingParams(max_tokens=None, min_tokens=10).max_tokens is None


def test_single_stop_string_is_accepted():
    assert SamplingParams(stop="###").stop == ("###",)


def test_temperatures_below_the_minimum_sample_greedily():
    assert SamplingParams(temperature=MIN_TEMPERATURE / 10).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


ANY_NUMBER = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([float("nan"), float("inf"), 1e-45, 1e300]),
)


NUMERIC_FIELDS = ["temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "stop_token_ids", "logprobs"]


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(NUMERIC_FIELDS), value=ANY_NUMBER)
def test_params_that_validate_pack_into_the_step_arrays_exactly(field, value):
    """Any number in any field: either SamplingParams rejects it with ValueError, or the
    step's fixed-width arrays hold it (no overflow, no inf/NaN, no float32 underflow to 0)."""
    try:
        p = SamplingParams(**{field: (value,) if field == "stop_token_ids" else value})
    except ValueError:
        return
    with np.errstate(over="raise", under="ignore"):
        s = SamplingArrays.from_params([p], [p.seed or 0])
    assert int(s.top_k[0]) == p.top_k and int(s.seed[0]) == (p.seed or 0)
    assert (p.max_tokens or 0) <= INT32_MAX and all(0 <= i <= INT32_MAX for i in p.stop_token_ids)
    for name in ("temperature", "top_p", "min_p"):
        assert np.isfinite(getattr(s, name)[0])
    assert (s.temperature[0] > 0) == (p.temperature > 0)  # a sampled row never turns greedy on the device
    assert p.greedy or np.isfinite(np.float32(100.0) / s.temperature[0])  # logits / T stays finite


def allowed_set(logits: np.ndarray, top_k: int, top_p: float, min_p: float, temperature: float) -> set[int]:
    """The tokens top-k, then top-p, then min-p may emit, computed the slow way in f64."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = list(order[: top_k or len(x)])
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    mass, kept = 0.0, []
    for tok, prob in zip(keep, p):
        if mass >= top_p:
            break
        kept.append(tok)
        mass += prob
    if min_p > 0:
        kept = [t for t in kept if x[t] >= x[order[0]] + np.log(min_p)]
    return set(int(t) for t in kept)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_filters_never_allow_a_token_outside_the_allowed_set(seed, top_k, top_p, min_p, temperature):
    rng = np.random.default_rng(seed)
    logits = rng.permutation(np.linspace(-4, 4, 16)).astype(np.float32)  # distinct values: no ties
    s = arrays(1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    filtered = np.asarray(filter_logits(jnp.asarray(logits[None]), s))[0]
    got = set(np.flatnonzero(np.isfinite(filtered)).tolist())
    want = allowed_set(logits, top_k, top_p, min_p, temperature)
    assert got == want
    draws = jax.vmap(lambda k: jax.random.categorical(k, jnp.asarray(filtered)))(
        jax.random.split(jax.random.key(seed), 64)
    )
    assert set(np.asarray(draws).tolist()) <= want


def test_partial_top_k_equals_the_threshold_search():
    """Top-k up to FAST_TOP_K cuts with a partial top-k, larger ones and top-p search the row
    for their threshold, min-p needs neither: each row keeps the same tokens whichever path
    its batch takes."""
    logits = jnp.asarray(np.random.default_rng(5).standard_normal((1, 1000)) * 3, jnp.float32)
    rows = [SamplingParams(top_k=7), SamplingParams(top_k=FAST_TOP_K), SamplingParams(min_p=0.05),
            SamplingParams(top_k=7, min_p=0.05)]
    alone = [np.asarray(filter_logits(logits, SamplingArrays.from_params([p], [0])))[0] for p in rows]
    for p, row in zip(rows, alone):  # the reference: k largest (values are distinct), p >= min_p * max p
        want = np.full(1000, True)
        if p.top_k:
            want &= np.asarray(logits[0]) >= np.sort(np.asarray(logits[0]))[-p.top_k]
        if p.min_p:
            want &= np.exp(np.asarray(logits[0]) - np.asarray(logits[0]).max()) >= p.min_p
        np.testing.assert_array_equal(np.isfinite(row), want)
    searched = rows + [SamplingParams(top_k=FAST_TOP_K + 1), SamplingParams(top_p=0.9)]  # these two: the search
    together = np.asarray(filter_logits(jnp.repeat(logits, len(searched), axis=0),
                                        SamplingArrays.from_params(searched, [0] * len(searched))))
    for row, got in zip(alone, together):
        np.testing.assert_array_equal(got, row)
    assert np.isfinite(together[4]).sum() == FAST_TOP_K + 1


def test_temperature_only_batches_skip_the_filters_and_agree_with_them():
    """A batch where no row filters returns logits / T (no top-k, no search); the same row
    in a batch that also filters goes through the filtering path and comes out identical."""
    logits = jnp.asarray(np.random.default_rng(3).permutation(np.linspace(-4, 4, 16))[None], jnp.float32)
    plain = np.asarray(filter_logits(logits, arrays(1, temperature=0.7)))[0]
    np.testing.assert_array_equal(plain, np.asarray(logits[0]) / np.float32(0.7))
    mixed = SamplingArrays.from_params([SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=3)], [0, 0])
    both = np.asarray(filter_logits(jnp.concatenate([logits, logits]), mixed))
    np.testing.assert_array_equal(both[0], plain)
    assert np.isfinite(both[1]).sum() == 3


def test_sampled_frequencies_match_the_filtered_softmax():
    """20k draws at distinct positions; chi-square against softmax(logits / T) after top-k."""
    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    s = arrays(1, temperature=0.7, top_k=4)
    n = 20_000
    draw = jax.jit(jax.vmap(lambda pos: sample_tokens(logits, s, pos[None])[0]))
    counts = np.bincount(np.asarray(draw(jnp.arange(n))), minlength=6)
    x = np.asarray(logits[0], np.float64)[:4] / 0.7
    p = np.exp(x - x.max())
    p /= p.sum()
    assert counts[4:].sum() == 0
    chi2 = ((counts[:4] - n * p) ** 2 / (n * p)).sum()
    # 3 degrees of freedom: P(chi2 > 16.27) = 0.001, so a correct sampler fails 1 time in
    # 1000 seeds; the seed is fixed, so this test is deterministic.
    assert chi2 < 16.27, (counts, n * p)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50)), jnp.float32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    s = SamplingArrays.from_params(params, [1, 2, 3])
    out = np.asarray(sample_tokens(logits, s, jnp.zeros(3, jnp.int32)))
    arg = np.asarray(jnp.argmax(logits, -1))
    assert out[0] == arg[0] and out[2] == arg[2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([-np.inf, -1.0, -0.0, 0.0, 0.5, 2.0, np.inf, np.nan]), min_size=1, max_size=12),
       st.integers(0, 2**31 - 1))
def test_greedy_tokens_is_argmax_with_ties_infinities_and_nan(values, seed):
    """The two-reduction argmax picks what `jnp.argmax` picks: the first maximum, NaN first."""
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.permutation(np.asarray(values, np.float32)) for _ in range(4)])  # f32[4, n]
    rows = np.concatenate([rows, rng.standard_normal((2, len(values))).astype(np.float32)])
    np.testing.assert_array_equal(np.asarray(greedy_tokens(jnp.asarray(rows))), np.asarray(jnp.argmax(rows, axis=-1)))
    blocks = jnp.asarray(rows.reshape(2, 3, -1))  # leading axes are kept: [B, k + 1, V] in verification
    np.testing.assert_array_equal(np.asarray(greedy_tokens(blocks)), np.asarray(jnp.argmax(blocks, axis=-1)))


def test_same_seed_and_position_repeat_exactly_and_rows_are_independent():
    logits = jnp.zeros((2, 1000))
    s = SamplingArrays.from_params([SamplingParams()] * 2, [7, 7])
    pos = jnp.arange(2, dtype=jnp.int32)
    a = np.asarray(sample_tokens(logits, s, pos))
    b = np.asarray(sample_tokens(logits, s, pos))
    np.testing.assert_array_equal(a, b)
    # The same row sampled alone (in a batch of different shape) gives the same token.
    alone = SamplingArrays.from_params([SamplingParams()], [7])
    assert int(sample_tokens(logits[:1], alone, pos[1:])[0]) == a[1]
    # Another seed gives another stream (1000-way uniform: 20 equal draws would be a bug).
    many = jnp.zeros((20, 1000))
    seq7 = sample_tokens(many, SamplingArrays.from_params([SamplingParams()] * 20, [7] * 20), jnp.arange(20))
    seq8 = sample_tokens(many, SamplingArrays.from_params([SamplingParams()] * 20, [8] * 20), jnp.arange(20))
    assert not np.array_equal(np.asarray(seq7), np.asarray(seq8))


ROW_PARAMS = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                       top_k=st.sampled_from([0, 1, 3, 40, 1000]), top_p=st.sampled_from([1.0, 0.2, 0.9, 0.999]),
                       min_p=st.sampled_from([0.0, 0.05]))


_filter, _sample = jax.jit(filter_logits), jax.jit(sample_tokens)  # one compiled shape: [4, 64]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(ROW_PARAMS, min_size=4, max_size=4), seed=st.integers(0, 10_000),
       scale=st.sampled_from([1.0, 8.0, 30.0]))
def test_each_row_filters_and_samples_as_if_alone(rows, seed, scale):
    """`sampling.py` promises a row's tokens depend only on its own logits, params, seed and
    position. Steep logits (scale 30) leave a tail whose float32 cumulative mass reaches 1
    early: a top_p = 1 row must keep that tail whatever its neighbours filter. "Alone" is
    the row repeated over the whole batch (so no neighbour filters unless it does)."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal((4, 64)) * scale, jnp.float32)
    positions = jnp.asarray(rng.integers(0, 100, 4), jnp.int32)
    s = SamplingArrays.from_params(rows, list(range(4)))
    together, drawn = np.asarray(_filter(logits, s)), np.asarray(_sample(logits, s, positions))
    for i, p in enumerate(rows):
        alone = SamplingArrays.from_params([p] * 4, [i] * 4)
        same = jnp.broadcast_to(logits[i], (4, 64)), jnp.broadcast_to(positions[i], (4,))
        np.testing.assert_array_equal(together[i], np.asarray(_filter(same[0], alone))[0])
        assert drawn[i] == int(_sample(*same[:1], alone, same[1])[0])


def test_an_unfiltered_row_keeps_its_tail_next_to_a_top_p_row():
    """The concrete case: one dominant token and 30 tokens of mass ~1e-8 each."""
    row = jnp.asarray([[10.0, 0.0] + [-8.0] * 30], jnp.float32)
    s = SamplingArrays.from_params([SamplingParams(), SamplingParams(top_p=0.5)], [0, 0])
    both = np.asarray(filter_logits(jnp.concatenate([row, row]), s))
    assert np.isfinite(both[0]).all() and np.isfinite(both[1]).sum() == 1


def test_top_p_and_large_top_k_over_a_wide_row_with_ties_match_a_float64_sort():
    """The threshold search against a sort in float64 over a 262,144-wide row (Gemma 3's
    vocabulary) of negative, positive, repeated and -inf logits: top-p keeps the most likely
    tokens until their mass reaches p, and every token tied with the last one kept; top-k
    keeps the k largest and their ties."""
    rng = np.random.default_rng(11)
    vocab = 262_144
    x = np.round(rng.standard_normal(vocab) * 4, 1).astype(np.float32)  # ~80 distinct values: many ties
    x[rng.integers(0, vocab, 1000)] = -np.inf
    x[:3] = [9.0, 8.5, 8.5]
    rows = [SamplingParams(top_p=0.3), SamplingParams(top_p=0.95), SamplingParams(top_k=5000),
            SamplingParams(top_k=5000, top_p=0.5), SamplingParams(top_p=1e-6), SamplingParams()]
    got = np.isfinite(np.asarray(jax.jit(filter_logits)(jnp.asarray(np.tile(x, (len(rows), 1))),
                                                         SamplingArrays.from_params(rows, [0] * len(rows)))))
    x64 = x.astype(np.float64)
    for row, p in zip(got, rows):
        keep = np.isfinite(x64)
        if p.top_k:
            keep &= x64 >= np.sort(x64)[-p.top_k]
        if p.top_p < 1:
            desc = np.sort(np.where(keep, x64, -np.inf))[::-1]
            probs = np.exp(desc - desc[0])
            probs /= probs.sum()
            last = np.searchsorted(np.cumsum(probs), p.top_p)  # the first index whose mass reaches p
            keep &= x64 >= desc[last]
        np.testing.assert_array_equal(row, keep)
    assert got[4].sum() == 1 and got[-1].sum() == vocab - np.isinf(x).sum()


def test_threshold_search_is_exact_to_the_last_bit():
    """Logits one float32 step apart, positive and negative, with -0.0 and 0.0: a large top-k
    keeps exactly k tokens and top-p exactly the tokens a float64 sort keeps; a goal the row
    cannot reach (float rounding near top_p = 1) keeps every token. (Subnormals are left out:
    XLA:CPU flushes them to zero.)"""
    from jaxinfer.sampling import _largest_reaching

    def run(start):  # 600 consecutive float32 values downwards from `start`
        return np.float32(start) - np.arange(600, dtype=np.float32) * np.spacing(np.float32(start))

    x = np.concatenate([run(9.0), run(-1.0), [-0.0, 0.0]]).astype(np.float32)
    rows = [SamplingParams(top_k=FAST_TOP_K + 44), SamplingParams(top_k=700), SamplingParams(top_p=0.37)]
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(np.tile(x, (3, 1))),
                                               SamplingArrays.from_params(rows, [0, 0, 0]))))
    assert got[0].sum() == FAST_TOP_K + 44 and got[0][:FAST_TOP_K + 44].all()
    np.testing.assert_array_equal(got[1], x >= np.sort(x)[-700])
    desc = np.sort(x.astype(np.float64))[::-1]
    probs = np.exp(desc - desc[0]) / np.exp(desc - desc[0]).sum()
    np.testing.assert_array_equal(got[2], x >= desc[np.searchsorted(np.cumsum(probs), 0.37)])
    short = _largest_reaching(jnp.asarray(x[None]), jnp.ones((1, x.size)), jnp.asarray([x.size + 1.0]))
    assert float(short[0, 0]) == x.min()
