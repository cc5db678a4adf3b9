"""The one attention reference checked by hand, and the kernels' shared pieces (no kernels run)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention.reference import paged_attention_reference
from jaxinfer.kv.dense import LayerKV
from pallas_kernels.common import AttentionOptions, page_schedule
from pallas_kernels.formats import KernelPages, from_layer_kv

# One sequence, one head, Dh = 1, page_size 2, q = 1, scale 1; keys at positions 0, 1, 2 hold
# log 1, log 2, log 3, so exp(score) = 1, 2, 3; values 1, 2, 3. The query sits at position 2.
#   causal:                     (1*1 + 2*2 + 3*3) / (1 + 2 + 3)        = 14/6
#   window 2 (keys 1, 2):       (2*2 + 3*3) / (2 + 3)                  = 13/5
#   window 1 + 1 sink (0, 2):   (1*1 + 3*3) / (1 + 3)                  = 10/4
#   sink logit log 4:           14 / (6 + 4)                           = 1.4
#   soft_cap 1: scores tanh(log x) = (x^2 - 1)/(x^2 + 1) = 0, 0.6, 0.8
#                               (1 + 2e^0.6 + 3e^0.8) / (1 + e^0.6 + e^0.8)
SOFT = (1 + 2 * math.exp(0.6) + 3 * math.exp(0.8)) / (1 + math.exp(0.6) + math.exp(0.8))
HAND = [
    (dict(), 14 / 6),
    (dict(window=2), 13 / 5),
    (dict(window=1, num_sinks=1), 10 / 4),
    (dict(sink_logits=jnp.array([math.log(4.0)])), 1.4),
    (dict(soft_cap=1.0), SOFT),
]


@pytest.mark.parametrize("options,expected", HAND, ids=["causal", "window", "sinks", "sink_logit", "soft_cap"])
def test_reference_matches_hand_computed_values(options, expected):
    k = jnp.array([0.0, math.log(2.0), math.log(3.0), jnp.nan]).reshape(2, 2, 1, 1)  # position 3: NaN, unowned
    v = jnp.array([1.0, 2.0, 3.0, jnp.nan]).reshape(2, 2, 1, 1)
    q, table, lengths, query = jnp.ones((1, 1, 1, 1)), jnp.array([[0, 1]]), jnp.array([3]), jnp.array([[2]])
    out = paged_attention_reference(q, LayerKV(k, v), table, lengths, query, 1.0, **options)
    np.testing.assert_allclose(float(out[0, 0, 0, 0]), expected, rtol=1e-6)


@pytest.mark.parametrize("options,expected", HAND, ids=["causal", "window", "sinks", "sink_logit", "soft_cap"])
def test_a_padded_query_row_is_zero(options, expected):
    """A chunk's padding row (query_index -1) sees no key: its output is 0, as the kernels give,
    whatever the other rows of its sequence see."""
    k = jnp.array([0.0, math.log(2.0), math.log(3.0), jnp.nan]).reshape(2, 2, 1, 1)
    v = jnp.array([1.0, 2.0, 3.0, jnp.nan]).reshape(2, 2, 1, 1)
    q, table, lengths, query = jnp.ones((1, 2, 1, 1)), jnp.array([[0, 1]]), jnp.array([3]), jnp.array([[2, -1]])
    out = paged_attention_reference(q, LayerKV(k, v), table, lengths, query, 1.0, **options)
    np.testing.assert_allclose(np.asarray(out[0, :, 0, 0]), [expected, 0.0], rtol=1e-6)


def _pages_needed(length, q_lo, q_hi, page, window, sinks):
    """Brute force: logical pages holding a key visible to some query in [q_lo, q_hi]."""
    need = set()
    for i in range(q_lo, q_hi + 1):
        for j in range(length):
            if j <= i and (window is None or j > i - window or j < sinks):
                need.add(j // page)
    return need


@pytest.mark.parametrize("page,window,sinks", [(2, None, 0), (4, None, 0), (2, 1, 0), (4, 3, 1), (2, 5, 3), (4, 6, 9)])
def test_page_schedule_reads_exactly_the_pages_with_visible_keys(page, window, sinks):
    """Pages wholly outside the window (and not sinks) are never in the schedule; nothing needed is missed."""
    combos = [(n, lo, hi) for n in range(0, 14) for lo in range(-1, 15) for hi in range(lo, min(lo + 4, 15))]
    n, lo, hi = (jnp.array(c, jnp.int32) for c in zip(*combos))
    opts = AttentionOptions(window=window, num_sinks=sinks)
    sched = page_schedule(n, lo, hi, page, opts)
    count = np.asarray(sched.count)
    steps = np.asarray(sched.logical_page(jnp.arange(8)[:, None]))  # [steps, combos]
    for c, (length, q_lo, q_hi) in enumerate(combos):
        walked = [int(p) for p in steps[: count[c], c]]
        assert walked == sorted(set(walked)), "pages are walked once each, in order"
        assert set(walked) == _pages_needed(length, q_lo, q_hi, page, window, sinks), (length, q_lo, q_hi)


def test_schedule_docstring_example():
    sched = page_schedule(23, 22, 22, 4, AttentionOptions(window=6, num_sinks=2))
    assert int(sched.count) == 3
    assert [int(sched.logical_page(i)) for i in range(3)] == [0, 4, 5]


def test_bad_options_and_formats_raise():
    with pytest.raises(ValueError, match="window"):
        AttentionOptions(window=0)
    with pytest.raises(ValueError, match="num_sinks"):
        AttentionOptions(num_sinks=-1)
    with pytest.raises(ValueError, match="format"):
        KernelPages(jnp.zeros((2, 2, 1, 4)), jnp.zeros((2, 2, 1, 4)), format="int3")
    with pytest.raises(ValueError, match="k_scale"):
        KernelPages(jnp.zeros((2, 2, 1, 4), jnp.int8), jnp.zeros((2, 2, 1, 4), jnp.int8), format="int8").validate()
    with pytest.raises(ValueError, match="no Pallas attention kernel"):
        from_layer_kv(object())


def test_the_reference_names_a_misshapen_batch():
    """What the kernels' checks name, the reference (what "auto" runs on CPU) names too."""
    layer = LayerKV(jnp.zeros((3, 4, 2, 16)), jnp.zeros((3, 4, 2, 16)))
    q, tables, lengths, query = jnp.zeros((2, 1, 4, 16)), jnp.zeros((2, 2), jnp.int32), jnp.ones(2, jnp.int32), \
        jnp.zeros((2, 1), jnp.int32)
    for args, named in [((q, tables[0], lengths, query), r"block_tables shape \(2,\) must be \[B, max_pages\]"),
                        ((q, jnp.zeros((3, 2), jnp.int32), lengths, query), r"block_tables shape \(3, 2\)"),
                        ((q, tables, jnp.ones(3, jnp.int32), query), r"kv_lengths shape \(3,\) must be \[B\]"),
                        ((q, tables, lengths, query[:, 0]), r"query_index shape \(2,\) must be \[B, T\]"),
                        ((q[:, 0], tables, lengths, query), r"q shape \(2, 4, 16\) must be \[B, T, Hq, Dh\]")]:
        with pytest.raises(ValueError, match=named):
            paged_attention_reference(args[0], layer, *args[1:], 1.0)
