"""The paged cache: isolation, equivalence of prefill/decode/chunking, allocator invariants."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.kv import NULL_PAGE, KVCacheSpec, LayerKV, OutOfPagesError, PageAllocator, partition_pages
from jaxinfer.model import forward
from jaxinfer.attention.reference import paged_attention_reference
from tiny_models import kv_with_pages, random_tokens, tiny_model

SPEC = KVCacheSpec(num_pages=24, page_size=4, max_slots=2, max_pages_per_seq=6)
T = 19  # not a page multiple: the last page is partly filled


def full_forward(config, params, tokens, pages, fill=0.0):
    kv = kv_with_pages(config, SPEC, pages, fill)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return forward(params, config, jnp.asarray(tokens), pos, kv)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_permuted_block_tables_and_poisoned_pages_do_not_change_outputs(heads):
    config, params = tiny_model(n_heads=heads[0], n_kv_heads=heads[1])
    tokens = random_tokens((2, T), config.vocab_size)
    contiguous = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    scattered = [[17, 3, 22, 9, 12], [5, 20, 1, 14, 8]]
    ref, _ = full_forward(config, params, tokens, contiguous)
    # Every page that is not the sequence's own holds NaN; so does the unwritten tail of
    # each sequence's last page. Any read of them would turn the logits into NaN.
    out, kv = full_forward(config, params, tokens, scattered, fill=np.nan)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(kv.lengths), [T, T])


def test_other_slots_pages_cannot_leak_into_a_sequence():
    """Slot 1 writes huge values into its pages; slot 0's logits are unchanged by them."""
    config, params = tiny_model()
    a = random_tokens((1, T), config.vocab_size, seed=1)
    pages = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    quiet, _ = full_forward(config, params, np.concatenate([a, a]), pages)
    noisy_kv = kv_with_pages(config, SPEC, pages)
    noisy_kv = noisy_kv.replace(layers=tuple(
        LayerKV(k=layer.k.at[6:11].set(1e4), v=layer.v.at[6:11].set(-1e4)) for layer in noisy_kv.layers
    ))
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    noisy, _ = forward(params, config, jnp.asarray(np.concatenate([a, a])), pos, noisy_kv,
                       num_new=jnp.array([T, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(noisy)[0], np.asarray(quiet)[0])


def test_prefill_then_decode_equals_one_full_forward():
    config, params = tiny_model()
    tokens = random_tokens((2, T), config.vocab_size, seed=2)
    pages = [[3, 1, 9, 4, 2], [5, 8, 6, 7, 10]]
    full, _ = full_forward(config, params, tokens, pages)

    prompt = 7
    kv = kv_with_pages(config, SPEC, pages, fill=np.nan)
    pos = jnp.broadcast_to(jnp.arange(prompt), (2, prompt))
    logits, kv = forward(params, config, jnp.asarray(tokens[:, :prompt]), pos, kv)
    steps = [logits]
    for t in range(prompt, T):
        logits, kv = forward(params, config, jnp.asarray(tokens[:, t : t + 1]), kv.lengths[:, None], kv)
        steps.append(logits)
    incremental = np.concatenate([np.asarray(s) for s in steps], axis=1)
    np.testing.assert_allclose(incremental, np.asarray(full), atol=2e-5, rtol=0)


def test_chunked_prefill_with_ragged_padding_equals_one_shot():
    """Rows advance by different amounts per call; padding tokens write nothing."""
    config, params = tiny_model()
    tokens = random_tokens((2, T), config.vocab_size, seed=3)
    pages = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    full, _ = full_forward(config, params, tokens, pages)

    kv = kv_with_pages(config, SPEC, pages, fill=np.nan)
    chunk, done = 5, np.zeros(2, np.int64)
    takes = [np.array([5, 3]), np.array([5, 5]), np.array([4, 5]), np.array([5, 5]), np.array([0, 1])]
    got = [[], []]
    for take in takes:
        batch = np.zeros((2, chunk), np.int32)
        for b in range(2):
            batch[b, : take[b]] = tokens[b, done[b] : done[b] + take[b]]
        pos = jnp.asarray(done[:, None] + np.arange(chunk), jnp.int32)
        logits, kv = forward(params, config, jnp.asarray(batch), pos, kv, num_new=jnp.asarray(take, jnp.int32))
        for b in range(2):
            got[b].append(np.asarray(logits)[b, : take[b]])
        done += take
    assert list(done) == [T, T]
    for b in range(2):
        np.testing.assert_allclose(np.concatenate(got[b]), np.asarray(full)[b], atol=2e-5, rtol=0)


def test_reference_attention_hand_computed():
    """One query, two keys, one head, Dh=1: scores q*k = [0, ln 3] -> softmax [1/4, 3/4].

    Output = 1/4 * v0 + 3/4 * v1 = 1/4 * 4 + 3/4 * 8 = 7. Key 2 is past the length, key 3
    lies on a poisoned page.
    """
    k_pages = jnp.array([[[[np.nan]], [[np.nan]]], [[[0.0]], [[np.log(3.0)]]], [[[5.0]], [[np.nan]]]])
    v_pages = jnp.array([[[[np.nan]], [[np.nan]]], [[[4.0]], [[8.0]]], [[[100.0]], [[np.nan]]]])
    q = jnp.ones((1, 1, 1, 1))
    out = paged_attention_reference(q, LayerKV(k=k_pages, v=v_pages), jnp.array([[1, 2]]), jnp.array([2]), jnp.array([[1]]), scale=1.0)
    np.testing.assert_allclose(np.asarray(out).ravel(), [7.0], rtol=1e-6)


def test_writes_to_unallocated_blocks_are_dropped():
    """A block-table entry of NULL_PAGE is never written, so the reserved page stays clean."""
    config, params = tiny_model()
    tokens = random_tokens((2, 8), config.vocab_size)
    kv = kv_with_pages(config, SPEC, [[1], [2]])  # room for 4 tokens, 8 arrive
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    _, kv = forward(params, config, jnp.asarray(tokens), pos, kv)
    for layer in kv.layers:
        assert not np.asarray(layer.k[NULL_PAGE]).any() and not np.asarray(layer.v[NULL_PAGE]).any()
        assert not np.asarray(layer.k[3:]).any()


# ---- PageAllocator properties -------------------------------------------------------------

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 6)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(2, 20), script=ops)
def test_allocator_never_hands_out_a_page_twice(num_pages, script):
    alloc = PageAllocator(num_pages)
    owned: list[list[int]] = []
    for op, n in script:
        if op == "alloc":
            before = alloc.num_free
            if n > before:
                with pytest.raises(OutOfPagesError):
                    alloc.allocate(n)
                assert alloc.num_free == before  # all or nothing
                continue
            owned.append(alloc.allocate(n))
        elif owned:
            alloc.free(owned.pop(n % len(owned)))
        held = [p for pages in owned for p in pages]
        assert len(held) == len(set(held)), "a page is owned twice"
        assert NULL_PAGE not in held
        assert all(0 < p < num_pages for p in held)
        assert alloc.num_free + len(held) == num_pages - 1  # conservation


@settings(max_examples=100, deadline=None)
@given(per_part=st.integers(2, 8), parts=st.integers(1, 4), script=ops, data=st.data())
def test_a_replica_allocator_stays_inside_its_page_range(per_part, parts, script, data):
    """`partition_pages` tiles the pool (NULL_PAGE excluded); an allocator over one part
    hands out only its pages, whatever the allocate/free/cache traffic."""
    num_pages = per_part * parts
    ranges = partition_pages(num_pages, parts)
    assert sorted(p for r in ranges for p in r) == list(range(1, num_pages))
    part = ranges[data.draw(st.integers(0, parts - 1))]
    alloc = PageAllocator(num_pages, part)
    owned: list[list[int]] = []
    for i, (op, n) in enumerate(script):
        if op == "alloc" and n <= alloc.num_free:
            owned.append(alloc.allocate(n))
            if owned[-1]:
                alloc.register(owned[-1][0], bytes([i]))  # some pages become cached on free
        elif op == "free" and owned:
            alloc.free(owned.pop(n % len(owned)))
        assert all(p in part for pages in owned for p in pages)
        alloc.check_invariants()


def test_partition_pages_rejects_uneven_pools():
    assert partition_pages(12, 3) == [range(1, 4), range(4, 8), range(8, 12)]
    for num_pages, parts in [(13, 2), (3, 3), (8, 0)]:
        with pytest.raises(ValueError, match="multiple"):
            partition_pages(num_pages, parts)
    with pytest.raises(ValueError, match="range"):
        PageAllocator(8, range(0, 4))  # would hand out NULL_PAGE


def test_allocator_rejects_bad_frees():
    alloc = PageAllocator(5)
    pages = alloc.allocate(2)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([4])
    with pytest.raises(ValueError, match="twice"):
        alloc.free([pages[0], pages[0]])
    alloc.free(pages)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(pages)
    with pytest.raises(ValueError):
        PageAllocator(1)
    with pytest.raises(ValueError):
        KVCacheSpec(num_pages=8, page_size=0, max_slots=1, max_pages_per_seq=2)


def test_two_token_groups_in_one_pass_equal_separate_passes():
    """A decode group [3 slots, 1] and a prefill group [1 slot, chunk] share one forward."""
    from jaxinfer.model import TokenGroup, forward_groups

    config, params = tiny_model()
    spec = KVCacheSpec(num_pages=40, page_size=4, max_slots=4, max_pages_per_seq=8)
    pages = [[1, 2, 3, 4], [9, 5, 7, 6], [11, 12, 13, 14], [20, 21, 22, 23]]
    prompt = random_tokens((4, 9), config.vocab_size, seed=4)
    kv = kv_with_pages(config, spec, pages, fill=np.nan)
    # Slots 0-2 hold a 9-token prompt; slot 3 is empty and will prefill 6 tokens.
    _, kv = forward(params, config, jnp.asarray(prompt[:3]), jnp.broadcast_to(jnp.arange(9), (3, 9)), kv)
    kv = kv.replace(lengths=jnp.asarray([9, 9, 9, 0], jnp.int32))
    decode = TokenGroup(tokens=jnp.asarray(prompt[:, :1]), positions=jnp.full((4, 1), 9, jnp.int32),
                        slots=jnp.arange(4, dtype=jnp.int32), num_new=jnp.asarray([1, 1, 1, 0], jnp.int32))
    chunk = random_tokens((1, 8), config.vocab_size, seed=5)
    prefill = TokenGroup(tokens=jnp.asarray(chunk), positions=jnp.arange(8, dtype=jnp.int32)[None],
                         slots=jnp.asarray([3], jnp.int32), num_new=jnp.asarray([6], jnp.int32))

    (dec_both, pre_both), kv_both = forward_groups(params, config, kv, (decode, prefill))
    (dec_alone,), _ = forward_groups(params, config, kv, (decode,))
    (pre_alone,), _ = forward_groups(params, config, kv, (prefill,))
    np.testing.assert_allclose(np.asarray(dec_both)[:3], np.asarray(dec_alone)[:3], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(pre_both)[0, :6], np.asarray(pre_alone)[0, :6], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(kv_both.lengths), [10, 10, 10, 6])


def test_kv_head_copies_store_each_head_r_times_and_reject_bad_counts():
    """init_paged_kv(kv_head_copies=r): r x the KV heads in per-head formats (KIVI keeps one);
    r must divide the GQA group, and MLA has no heads to copy."""
    from jaxinfer.kv import init_paged_kv
    from test_attention_variants import mla_tiny_config

    config, _ = tiny_model(n_heads=8, n_kv_heads=2)
    spec = KVCacheSpec(num_pages=4, page_size=4, max_slots=2, max_pages_per_seq=2)
    assert init_paged_kv(config, spec, kv_head_copies=4).layers[0].k.shape == (4, 4, 8, config.head_dim)
    assert init_paged_kv(config, spec, kv_cache="int8", kv_head_copies=2).layers[0].k_scale.shape == (4, 4, 4)
    assert init_paged_kv(config, spec, kv_cache="int4", kv_head_copies=2).layers[0].k_q.shape[2] == 2
    with pytest.raises(ValueError, match="kv_head_copies=3 must divide"):
        init_paged_kv(config, spec, kv_head_copies=3)
    with pytest.raises(ValueError, match="positive integer"):
        init_paged_kv(config, spec, kv_head_copies=0)
    with pytest.raises(ValueError, match="MLA"):
        init_paged_kv(mla_tiny_config(), spec, kv_head_copies=2)
