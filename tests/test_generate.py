"""The static-batch generator: stops, streaming, batching invariance, seeds, bad input, compiles."""

from __future__ import annotations

import pytest

from jaxinfer.generate import Generator
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
from jaxinfer.steps import decode_and_sample, prefill_and_sample
from jaxinfer.tokenizer import Tokenizer
from tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(smollm2_gguf) -> Model:
    """A tiny random-weight model speaking SmolLM2's vocabulary (so text and stops are real)."""
    tok = Tokenizer.from_gguf(smollm2_gguf)
    config, params = tiny_model(vocab_size=tok.vocab_size, eos_ids=tok.eos_ids)
    return Model(config=config, params=params, tokenizer=tok)


@pytest.fixture
def gen(model) -> Generator:
    return Generator(model, max_batch=3, max_seq_len=64, page_size=8)


PROMPTS = ["The quick brown fox", "Über café: naïve résumé 🎉", "def f(x):\n\treturn x  +  1"]


def test_streamed_text_equals_final_text(gen):
    pieces = list(gen.stream(PROMPTS[1], GREEDY))
    [final] = gen.generate([PROMPTS[1]], GREEDY)
    assert "".join(pieces) == final.text
    assert final.text == gen.model.tokenizer.decode(final.token_ids)
    assert final.finish_reason == "length" and len(final.token_ids) == 24


def test_stop_string_cuts_the_text_and_stops(gen):
    [full] = gen.generate([PROMPTS[0]], GREEDY)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert len(stop) == 3
    cut = full.text.find(stop)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,))
    streamed = "".join(gen.stream(PROMPTS[0], params))
    [out] = gen.generate([PROMPTS[0]], params)
    assert out.text == full.text[:cut] == streamed
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 24


def test_stop_token_and_eos_end_generation_including_the_token(gen, model):
    [full] = gen.generate([PROMPTS[2]], GREEDY)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    [out] = gen.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop_id,)))
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"

    eos_model = Model(config=model.config.replace(eos_ids=(stop_id,)), params=model.params, tokenizer=model.tokenizer)
    [out] = Generator(eos_model, max_batch=1, max_seq_len=64).generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24))
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24)],
                         ids=["greedy", "seeded"])
def test_batched_equals_alone(gen, params):
    together = gen.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together):
        [alone] = gen.generate([prompt], params)
        assert alone.token_ids == out.token_ids


def test_seeded_sampling_repeats_and_seeds_differ(gen):
    p = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    a = gen.generate([PROMPTS[0]], p)[0].token_ids
    assert gen.generate([PROMPTS[0]], p)[0].token_ids == a
    q = SamplingParams(temperature=1.0, seed=12, max_tokens=24, ignore_eos=True)
    assert gen.generate([PROMPTS[0]], q)[0].token_ids != a


def test_bad_input_raises_and_the_generator_keeps_working(gen):
    with pytest.raises(ValueError, match="empty"):
        gen.generate([""], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(ValueError, match="max_seq_len"):
        gen.generate(["word " * 80], GREEDY)
    with pytest.raises(ValueError, match="max_batch"):
        gen.generate(PROMPTS + PROMPTS, GREEDY)
    with pytest.raises(ValueError, match="non-empty list"):
        gen.generate("a bare string", GREEDY)
    assert gen.allocator.num_allocated == 0
    assert len(gen.generate([PROMPTS[0]], GREEDY)[0].token_ids) == 24


def test_no_recompilation_across_calls(gen):
    """After one pass over the prompt-length buckets, different prompts, batch sizes and
    sampling settings reuse the same programs."""

    def traffic(seed: int) -> None:
        for i in range(6):
            prompts = [p + f" again {seed}" * i for p in PROMPTS[: 1 + (i + seed) % 3]]
            params = SamplingParams(temperature=0.5 * ((i + seed) % 2), top_p=0.8, seed=i, max_tokens=5 + i)
            gen.generate(prompts, params)

    traffic(0)
    before = prefill_and_sample._cache_size(), decode_and_sample._cache_size()
    traffic(1)
    traffic(2)
    assert (prefill_and_sample._cache_size(), decode_and_sample._cache_size()) == before
