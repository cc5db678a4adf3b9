"""N-gram drafts: the incremental `NgramIndex` against the `propose_ngram` reference, match
continuation, and greedy speculation with it == plain greedy decoding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
from jaxinfer.speculative import SpeculativeConfig, propose_ngram
from jaxinfer.speculative.drafts.ngram import NgramIndex
from tiny_models import tiny_model

# a 4-token alphabet: random sequences repeat their n-grams often
sequences = st.lists(st.integers(0, 3), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(tokens=sequences, chunks=st.lists(st.integers(1, 7), min_size=1, max_size=60),
       ngram_max=st.integers(1, 4), ngram_min=st.integers(1, 4), k=st.integers(1, 8))
def test_index_search_equals_propose_ngram(tokens, chunks, ngram_max, ngram_min, k):
    """Fed in chunks of any size, the index proposes what a full re-scan does."""
    ngram_min = min(ngram_min, ngram_max)
    index, fed = NgramIndex(ngram_max, ngram_min), 0
    for size in chunks:
        index.extend(tokens[fed : fed + size])
        fed = min(fed + size, len(tokens))
        expected = propose_ngram(np.asarray(tokens[:fed], np.int32), k, ngram_max, ngram_min).tolist()
        assert index.search(k) == expected


@settings(max_examples=200, deadline=None)
@given(tokens=sequences, prompt_len=st.integers(0, 30), k=st.integers(1, 8), prompt_first=st.booleans())
def test_proposals_continue_an_earlier_occurrence(tokens, prompt_len, k, prompt_first):
    """Followed matches and fresh ones alike: the drafts are what came after an earlier
    occurrence of the last ngram_min tokens (so they can only help)."""
    index = NgramIndex(3, 2, prompt_len, prompt_first, short_draft=2)
    for length in range(1, len(tokens) + 1):
        index.extend(tokens[length - 1 : length])
        drafts = index.propose(k)
        assert len(drafts) <= k
        if drafts:
            suffix = tokens[length - 2 : length]
            assert any(tokens[s - 2 : s] == suffix and tokens[s : s + len(drafts)] == drafts
                       for s in range(2, length)), (tokens[:length], drafts)


def test_a_fully_accepted_match_is_followed_past_later_occurrences():
    #        0  1  2  3  4  5  6   7  8  9   10 11
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 3, 4, 8, 1, 2]
    index = NgramIndex(3, 2, short_draft=None)
    index.extend(tokens)
    assert index.propose(3) == [3, 4, 5]  # "1 2" at 0
    index.extend([3, 4, 5, 6])  # three drafts and the bonus token accepted
    # a re-scan would match "5 6" (only at 4) too, but "3 4" (latest at 8) shows that
    # searching the last 2 tokens alone can jump elsewhere; following keeps the long match
    assert index.propose(2) == [7, 9]
    index.extend([0])  # a rejected draft: search again ("6 0" occurs nowhere)
    assert index.propose(2) == []


def test_short_matches_propose_fewer_drafts_and_the_prompt_can_win():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    index = NgramIndex(3, 2, len(prompt), short_draft=2)
    index.extend(prompt + [9, 1, 2])
    assert index.propose(8) == [3, 4]  # "1 2": a 2-gram, shorter than ngram_max
    index = NgramIndex(3, 2, len(prompt), short_draft=2)
    index.extend(prompt + [9, 0, 1, 2, 3])
    assert index.propose(8) == [4, 5, 6, 7, 8, 9, 0, 1]  # "1 2 3": a full match gets all k
    output = [5, 6, 7, 0, 5, 6, 7]  # "5 6 7": in the prompt (then 8) and in the output (then 0)
    latest, in_prompt = NgramIndex(3, 2, len(prompt)), NgramIndex(3, 2, len(prompt), prompt_first=True)
    for index in (latest, in_prompt):
        index.extend(prompt + output)
    assert latest.propose(2) == [0, 5] and in_prompt.propose(2) == [8, 5]


def test_sync_appends_only_new_tokens():
    index = NgramIndex(3, 2, prompt_len=3)
    index.sync([1, 2, 3], [])
    index.sync([1, 2, 3], [1, 2])
    index.sync([1, 2, 3], [1, 2, 3, 1])
    assert index.tokens == [1, 2, 3, 1, 2, 3, 1]


@pytest.fixture(scope="module")
def model() -> Model:
    config, params = tiny_model(max_position=512)
    return Model(config=config, params=params, tokenizer=None)


def copy_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (what a copying answer gives prompt lookup)."""
    rng = np.random.default_rng(0)
    text = [rng.integers(0, 97, n).tolist() for n in (6, 9, 13, 20)]
    return [t * 3 for t in text] + [text[0] + text[1] + text[0], text[3] + text[2] + text[3][:10]]


def generate(model, speculative) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, EngineConfig(max_slots=4, page_size=8, prefill_chunk=16, max_model_len=96, num_pages=14,
                                        speculative=speculative))
    outs = engine.generate(copy_prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [o.token_ids for o in outs], engine


@pytest.fixture(scope="module")
def plain(model) -> list[list[int]]:
    return generate(model, None)[0]


@pytest.mark.parametrize("options", [{}, {"ngram_short_draft": None, "ngram_prompt_first": True},
                                     {"ngram_min": 1, "ngram_max": 4}])
def test_greedy_ngram_speculation_on_copy_prompts_equals_plain(model, plain, options):
    """k = 8 (block widths 1, 2, 4, 8), with preemption (14 pages for 4 slots of <= 84 tokens)."""
    tokens, engine = generate(model, SpeculativeConfig("ngram", 8, **options))
    assert tokens == plain
    stats = engine.metrics()
    assert stats.speculative.accepted.sum() > 0 and stats.preemptions > 0
