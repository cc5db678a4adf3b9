"""`bad_words` (vLLM's): vLLM's tokenization rule, the host mask after each token and each
draft, engine outputs equal to a reference decoding loop that masks on the host (sampled, with
the engine's keys), the same tokens speculatively and beside a grammar, and clear errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.bad_words import AllOf, BadWords, bad_word_ids
from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingArrays, SamplingParams
from jaxinfer.structured_output import StructuredOutputsParams
from test_engine_text import model  # noqa: F401 - a tiny random model speaking SmolLM2's vocabulary
from test_penalties import last_logits, sample

PROMPTS = ["The quick brown fox", "Once upon a time", "def f(x):"]


def banned(mask: np.ndarray) -> set[int]:
    """The tokens a packed i32[W] bitmask does not allow."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits == 0).tolist())


def test_masks_follow_the_output_and_each_draft():
    bad = BadWords([(5,), (7, 8, 9), (8, 2)], vocab=40)
    assert banned(bad.allowed()) == {5}
    for token, expect in [(7, {5}), (8, {5, 9, 2}), (1, {5}), (8, {5, 2})]:
        bad.consume(token)
        assert banned(bad.allowed()) == expect
    fresh = BadWords([(5,), (7, 8, 9)], vocab=40)
    masks = fresh.draft_masks([7, 8, 9, 3])  # 9 is refused after 7, 8: the drafts stop before it
    assert [banned(m) for m in masks] == [{5}, {5, 9}]
    assert banned(fresh.allowed()) == {5}  # drafts are tentative: nothing moved
    assert len(fresh.draft_masks([5, 1])) == 0


def test_all_of_needs_both():
    first, second = BadWords([(3,)], vocab=40), BadWords([(4, 6)], vocab=40)
    both = AllOf(first, second)
    both.consume(4)
    assert banned(both.allowed()) == {3, 6}
    assert len(both.draft_masks([1, 3])) == 1 and not both.done


def test_words_are_tokenized_as_vllm_does(model):
    tok = model.tokenizer
    vocab = model.config.vocab_size
    seqs = bad_word_ids(tok, ["Paris", " capital city", "oblique"], vocab)
    # each word alone and after a space; " oblique" is one token, "oblique" two (vLLM would keep only those)
    for word in ("Paris", "capital city", "oblique"):
        assert {tuple(tok.encode(w, add_special_tokens=False)) for w in (word, " " + word)} <= set(seqs)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", "  "])


def reference_decode(model: Model, prompt: list[int], p: SamplingParams, seed: int,
                     sequences: list[tuple[int, ...]]) -> list[int]:
    """A dense forward per token; every bad word whose other tokens end the output has its last
    token's logit at -inf; the engine's sampling key (seed, position)."""
    out: list[int] = []
    while len(out) < p.max_tokens and not set(model.config.eos_ids) & set(out[-1:]):
        logits = last_logits(model, prompt + out)[None].copy()
        for seq in sequences:
            if len(out) >= len(seq) - 1 and tuple(out[len(out) - len(seq) + 1:]) == seq[:-1]:
                logits[0, seq[-1]] = -np.inf
        out.append(int(sample(jnp.asarray(logits), SamplingArrays.from_params([p], [seed]),
                              jnp.asarray([len(prompt) + len(out)]))[0]))
    return out


def engine(model: Model, **changes) -> Engine:
    return Engine(model, EngineConfig(**(dict(max_slots=3, page_size=8, prefill_chunk=16, max_model_len=128) | changes)))


def written_word(tok, output: list[int], n: int) -> str:
    """The text of n tokens of `output` that `bad_word_ids` reads back as those tokens."""
    for i in range(len(output) - n + 1):
        span, text = tuple(output[i:i + n]), tok.decode(output[i:i + n])
        if text.strip() and span in (tuple(tok.encode(text.lstrip(), add_special_tokens=False)),
                                     tuple(tok.encode(" " + text.lstrip(), add_special_tokens=False))):
            return text
    raise AssertionError(f"no {n} tokens of {output} spell a word")


def test_outputs_never_hold_a_bad_word_and_equal_the_reference(model):
    tok, eng = model.tokenizer, engine(model)
    prompts = [tok.encode(p) for p in PROMPTS]
    plain = eng.generate(prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True))
    # words the model writes without them: one of a single token, one of two
    words = [written_word(tok, plain[0].token_ids, 1), written_word(tok, plain[1].token_ids, 2)]
    sequences = bad_word_ids(tok, words, model.config.vocab_size)
    held = lambda out: [s for s in sequences if any(tuple(out[i:i + len(s)]) == s for i in range(len(out)))]  # noqa: E731
    assert held(plain[0].token_ids) and held(plain[1].token_ids)
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True, bad_words=words)] * 3
    outs = eng.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.token_ids == reference_decode(model, prompt, p, 1, sequences)
        assert not held(out.token_ids)
    for changes in (dict(speculative=SpeculativeConfig("ngram", 3)), dict(async_scheduling=True)):
        assert [o.token_ids for o in engine(model, **changes).generate(prompts, params)] == [o.token_ids for o in outs]


def test_bad_words_beside_a_grammar(model):
    """With a grammar the mask is both's: the output follows the grammar and avoids the word
    (bad words are token sequences, as in vLLM: the grammar may spell the word otherwise)."""
    eng, choices = engine(model), ["red blue", "green blue"]
    structured = StructuredOutputsParams(choice=choices)
    first = eng.generate(["Colour:"], SamplingParams(temperature=0, structured_outputs=structured))[0].token_ids
    avoid = written_word(model.tokenizer, first, 1)
    out = eng.generate(["Colour:"], SamplingParams(temperature=0, structured_outputs=structured, bad_words=[avoid]))[0]
    avoided = bad_word_ids(model.tokenizer, [avoid], model.config.vocab_size)
    assert out.text in choices and not {(t,) for t in out.token_ids} & set(avoided) and out.token_ids != first
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad_word_ids(model.tokenizer, ["x"], vocab=2)
