"""Text through the engine: streaming, stop strings, stop ids and EOS, chat prompts."""

from __future__ import annotations

import pytest

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer import Tokenizer
from tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Über café: naïve résumé 🎉", "def f(x):\n\treturn x  +  1"]


@pytest.fixture(scope="module")
def model(smollm2_gguf) -> Model:
    """A tiny random-weight model speaking SmolLM2's vocabulary (so text and stops are real)."""
    tok = Tokenizer.from_gguf(smollm2_gguf)
    config, params = tiny_model(vocab_size=tok.vocab_size, eos_ids=tok.eos_ids)
    return Model(config=config, params=params, tokenizer=tok)


@pytest.fixture
def eng(model) -> Engine:
    return Engine(model, EngineConfig(max_slots=3, page_size=8, prefill_chunk=16, max_model_len=128))


def test_streamed_text_equals_final_text(eng):
    pieces = list(eng.stream(PROMPTS[1], GREEDY))
    [final] = eng.generate([PROMPTS[1]], GREEDY)
    assert "".join(pieces) == final.text
    assert final.text == eng.model.tokenizer.decode(final.token_ids)
    assert final.finish_reason == "length" and len(final.token_ids) == 24


def test_stop_string_cuts_the_text_and_stops(eng):
    [full] = eng.generate([PROMPTS[0]], GREEDY)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert len(stop) == 3
    cut = full.text.find(stop)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,))
    streamed = "".join(eng.stream(PROMPTS[0], params))
    [out] = eng.generate([PROMPTS[0]], params)
    assert out.text == full.text[:cut] == streamed
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 24


def test_stop_token_and_eos_end_generation_including_the_token(eng, model):
    [full] = eng.generate([PROMPTS[2]], GREEDY)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    [out] = eng.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop_id,)))
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"

    eos_model = Model(config=model.config.replace(eos_ids=(stop_id,)), params=model.params, tokenizer=model.tokenizer)
    eos_engine = Engine(eos_model, EngineConfig(max_slots=1, max_model_len=64))
    [out] = eos_engine.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24))
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"


def test_chat_prompts_use_the_template(eng, model):
    eng.add_request("Hi there", GREEDY, request_id="chat", chat=True)
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert eng.requests["chat"].prompt == model.tokenizer.encode(text, add_special_tokens=False)
    eng.abort("chat")


def test_generate_rejects_a_bad_batch_without_leaving_requests_behind(eng):
    with pytest.raises(ValueError, match="empty"):
        eng.generate([PROMPTS[0], ""], GREEDY)
    with pytest.raises(ValueError, match="non-empty list"):
        eng.generate("a bare string", GREEDY)
    assert not eng.requests and not eng.has_unfinished_requests()
    assert len(eng.generate([PROMPTS[0]], GREEDY)[0].token_ids) == 24
