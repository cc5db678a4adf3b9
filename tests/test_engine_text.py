"""Text through the engine: streaming, stop strings, stop ids and EOS, chat prompts."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.engine.request import Request
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
    assert (out.finish_reason, out.stop_reason) == ("stop", stop) and full.stop_reason is None
    assert len(out.token_ids) < 24


def test_stop_token_and_eos_end_generation_including_the_token(eng, model):
    [full] = eng.generate([PROMPTS[2]], GREEDY)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    [out] = eng.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop_id,)))
    assert out.token_ids == full.token_ids[: first + 1] and (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    eos_model = Model(config=model.config.replace(eos_ids=(stop_id,)), params=model.params, tokenizer=model.tokenizer)
    eos_engine = Engine(eos_model, EngineConfig(max_slots=1, max_model_len=64))
    [out] = eos_engine.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24))
    assert out.token_ids == full.token_ids[: first + 1] and (out.finish_reason, out.stop_reason) == ("stop", None)


def test_min_tokens_and_include_stop_str_in_output(eng, model):
    """A stop string, a stop id and EOS that greedy decoding meets early do not end the
    request before min_tokens; include_stop_str_in_output keeps the stop string, streamed too."""
    [full] = eng.generate([PROMPTS[0]], GREEDY)
    stop, stop_id = full.text[2:5], full.token_ids[1]
    [out] = eng.generate([PROMPTS[0]], dataclasses.replace(GREEDY, min_tokens=24, stop=(stop,)))
    assert out.token_ids == full.token_ids and out.finish_reason == "length"
    [out] = eng.generate([PROMPTS[0]], dataclasses.replace(GREEDY, min_tokens=24, stop_token_ids=(stop_id,)))
    assert len(out.token_ids) == 24 and stop_id not in out.token_ids and out.finish_reason == "length"
    eos_engine = Engine(Model(config=model.config.replace(eos_ids=(stop_id,)), params=model.params,
                              tokenizer=model.tokenizer), EngineConfig(max_slots=1, max_model_len=64))
    [eos_out] = eos_engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, min_tokens=24))
    assert eos_out.token_ids == out.token_ids

    kept = dataclasses.replace(GREEDY, stop=(stop,), include_stop_str_in_output=True)
    [out] = eng.generate([PROMPTS[0]], kept)
    assert out.text == "".join(eng.stream(PROMPTS[0], kept)) == full.text[: full.text.find(stop) + 3]
    assert out.finish_reason == "stop"
    # a stop token's text too (vLLM's): the text of every token, the stop token's included
    by_id = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(full.token_ids[3],))
    kept, cut = (eng.generate([PROMPTS[0]], dataclasses.replace(by_id, include_stop_str_in_output=keep))[0]
                 for keep in (True, False))
    assert kept.token_ids == cut.token_ids and kept.stop_reason == full.token_ids[3]
    tok = model.tokenizer
    assert (kept.text, cut.text) == (tok.decode(kept.token_ids), tok.decode(kept.token_ids[:-1])) and kept.text != cut.text


def test_chat_prompts_use_the_template(eng, model):
    eng.add_request("Hi there", GREEDY, request_id="chat", chat=True)
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert eng.requests["chat"].prompt == model.tokenizer.encode(text, add_special_tokens=False)
    eng.abort("chat")


def test_conversations_are_prompts(eng, model):
    """A list of message dicts is a prompt rendered with the chat template (the assistant's turn
    opened), with or without `chat`; answers equal those to its token ids. Lists of anything
    else than ids or messages are refused by name, never cast."""
    tok = model.tokenizer
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = tok.encode(tok.apply_chat_template(conversation), add_special_tokens=False)
    by_messages, by_ids = eng.generate([conversation, ids], GREEDY)
    assert by_messages.prompt_token_ids == ids and by_messages.token_ids == by_ids.token_ids
    assert eng.generate([tuple(conversation)], GREEDY, chat=True)[0].token_ids == by_ids.token_ids
    for bad, named in [([1, 2.5], "holding float 2.5"), ([[1, 2]], "holding list"),
                       ({"role": "user"}, "a conversation is a list"),
                       ([{"role": "user"}], "content")]:
        with pytest.raises(ValueError, match=named):
            eng.add_request(bad, GREEDY)
    assert not eng.requests


def test_chat_renders_each_conversation_with_the_templates_options(model):
    """`Engine.chat` (vLLM's `LLM.chat`): one conversation or a list; `chat_template_kwargs`
    reach the template (Qwen3's `enable_thinking`), `continue_final_message` continues the last
    turn; answers equal `generate` on the rendered ids."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    tok = model.tokenizer.with_chat_template(template)
    eng = Engine(dataclasses.replace(model, tokenizer=tok), EngineConfig(max_slots=3, page_size=8, max_model_len=128))
    hi, bye = [{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]
    [one] = eng.chat(hi, GREEDY)
    two = eng.chat([hi, bye], GREEDY, chat_template_kwargs={"enable_thinking": False})
    assert one.prompt_token_ids == tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                                              add_special_tokens=False)
    assert tok.decode(two[0].prompt_token_ids, skip_special_tokens=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert two[1].token_ids == eng.generate([two[1].prompt_token_ids], GREEDY)[0].token_ids
    [cont] = eng.chat(hi + [{"role": "assistant", "content": "Hello"}], GREEDY, continue_final_message=True)
    assert tok.decode(cont.prompt_token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nHello")


def test_n_samples_per_prompt_are_its_outputs(eng):
    """vLLM's `SamplingParams(n)`: `generate` / `chat` give one output per prompt holding n
    samples (`outputs[i]`), sample i exactly what seed + i gives alone; the output's own
    fields are sample 0's; `cumulative_logprob` sums the logprobs. A request is one sample."""
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = eng.generate(PROMPTS[:2], params)
    assert len(outs) == 2
    for prompt, out in zip(PROMPTS, outs):
        alone = [eng.generate(prompt, dataclasses.replace(params, n=1, seed=7 + i))[0] for i in range(3)]
        assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs] == [
            (i, a.token_ids, a.text, a.finish_reason) for i, a in enumerate(alone)]
        assert out.token_ids == out.outputs[0].token_ids and out.prompt == prompt
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct samples
        assert all(c.cumulative_logprob == pytest.approx(sum(a.logprobs), abs=1e-4) for c, a in zip(out.outputs, alone))
    unseeded = eng.generate(PROMPTS[0], dataclasses.replace(params, seed=None))[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) > 1
    [chat] = eng.chat([{"role": "user", "content": "Hi"}], dataclasses.replace(params, n=2))
    assert len(chat.outputs) == 2 and chat.prompt.endswith("assistant\n")
    [one] = eng.generate(PROMPTS[0], GREEDY)
    assert [(c.token_ids, c.cumulative_logprob) for c in one.outputs] == [(one.token_ids, None)]
    with pytest.raises(ValueError, match="n=2: a request is one sample"):
        eng.add_request(PROMPTS[0], SamplingParams(n=2))
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="n="):
            SamplingParams(n=bad)


def test_vllm_prompt_dicts_names_and_truncation(eng, model):
    """vLLM's offline API spelled its way: prompt dicts, `sampling_params=` / `use_tqdm=`,
    `get_tokenizer()`, `chat(chat_template=)`, `truncate_prompt_tokens`, and `.prompt`."""
    tok = model.tokenizer
    ids = tok.encode(PROMPTS[0])
    by_text, by_ids = eng.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], sampling_params=GREEDY,
                                   use_tqdm=False)
    [plain] = eng.generate(PROMPTS[0], GREEDY)
    assert by_text.token_ids == by_ids.token_ids == plain.token_ids and by_ids.prompt_token_ids == ids
    assert (by_text.prompt, by_ids.prompt, plain.prompt) == (PROMPTS[0], None, PROMPTS[0])
    assert eng.generate({"prompt": PROMPTS[0]}, GREEDY)[0].token_ids == plain.token_ids  # one dict alone
    for bad, named in [({"prompt": "x", "multi_modal_data": {}}, "multi_modal_data"), ({"prompt": [1, 2]}, "a text"),
                       ({"prompt": "x", "prompt_token_ids": [1]}, "one of")]:
        with pytest.raises(ValueError, match=named):
            eng.generate(bad, GREEDY)
    with pytest.raises(ValueError, match="not both"):
        eng.generate(PROMPTS[0], GREEDY, sampling_params=GREEDY)
    assert eng.get_tokenizer() is tok
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    [templated] = eng.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template=template)
    assert templated.prompt == "[Hi]>" and templated.prompt_token_ids == tok.encode("[Hi]>", add_special_tokens=False)
    long = (ids * 20)[:100]
    cut = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=30)
    [out] = eng.generate([long], cut)
    assert out.prompt_token_ids == long[-30:] and out.token_ids == eng.generate([long[-30:]], cut)[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_generate_rejects_a_bad_batch_without_leaving_requests_behind(eng):
    with pytest.raises(ValueError, match="empty"):
        eng.generate([PROMPTS[0], ""], GREEDY)
    with pytest.raises(ValueError, match="non-empty list"):
        eng.generate([], GREEDY)
    assert not eng.requests and not eng.has_unfinished_requests()
    [out] = eng.generate([PROMPTS[0]], GREEDY)
    assert len(out.token_ids) == 24
    assert [o.token_ids for o in eng.generate(PROMPTS[0], GREEDY)] == [out.token_ids]  # a text alone: a batch of one


class _PieceDecoder:
    """A stream decoder whose token i decodes to pieces[i] (stands in for a tokenizer's)."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def push(self, token: int) -> str:
        return self.pieces[token]

    def flush(self) -> str:
        return ""


class _PieceTokenizer:
    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def stream_decoder(self, skip_special_tokens: bool = True) -> _PieceDecoder:
        return _PieceDecoder(self.pieces)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("ab", max_size=3), min_size=1, max_size=12), st.lists(st.text("ab", min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 6), st.booleans())
def test_stop_strings_cut_where_a_search_of_the_whole_text_after_each_token_would(pieces, stops, min_tokens, include):
    """The request searches only the tail a new piece can complete; the obvious way (every
    occurrence in the whole text after each piece, keeping those that end in the new piece,
    none before min_tokens pieces) must give the same text and stopping token, with the
    stop string cut or kept (include_stop_str_in_output)."""
    want, want_stopped_at = "", None
    for i, piece in enumerate(pieces):
        before = len(want)
        want += piece
        hits = [(at, order, stop) for order, stop in enumerate(stops) for at in range(len(want))
                if want.startswith(stop, at) and at + len(stop) > before]
        if hits and i + 1 >= min_tokens:
            at, _, stop = min(hits)
            want, want_stopped_at = want[: at + len(stop) if include else at], i
            break
    params = SamplingParams(max_tokens=100, stop=tuple(stops), min_tokens=min_tokens, include_stop_str_in_output=include)
    req = Request("r", [0], params, seed=0, eos_ids=(), tokenizer=_PieceTokenizer(pieces), cache_salt=None)
    stopped_at = None
    for i in range(len(pieces)):
        req.append_token(i, now=0.0)
        if req.finish_reason is not None:
            stopped_at = i
            break
    assert (req.text, stopped_at) == (want, want_stopped_at)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.lists(st.integers(0, 9), max_size=8), st.data())
def test_request_token_slices_equal_slices_of_all_tokens(prompt, generated, data):
    req = Request("r", prompt, SamplingParams(), seed=0, eos_ids=(), tokenizer=None, cache_salt=None)
    req.generated = list(generated)
    n = req.num_tokens
    assert n == len(req.all_tokens)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    assert req.tokens(start, stop) == req.all_tokens[start:stop]
    assert [req.token_at(i) for i in range(n)] == req.all_tokens


def outputs_by_step(eng: Engine, prompt: str, params: SamplingParams) -> list:
    rid = eng.add_request(prompt, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("asynchronous", [False, True])
def test_output_kinds_delta_and_final_only_add_up_to_cumulative(model, asynchronous):
    """output_kind "delta" holds only what is new (its pieces add up to the cumulative
    output, stop string and logprobs included); "final_only" reports once, at the end."""
    eng = Engine(model, EngineConfig(max_slots=3, page_size=8, prefill_chunk=16, max_model_len=128,
                                     async_scheduling=asynchronous))
    [full] = eng.generate([PROMPTS[0]], GREEDY)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,), logprobs=2)
    cumulative = outputs_by_step(eng, PROMPTS[0], base)
    delta = outputs_by_step(eng, PROMPTS[0], dataclasses.replace(base, output_kind="delta"))
    final = outputs_by_step(eng, PROMPTS[0], dataclasses.replace(base, output_kind="final_only"))
    last = cumulative[-1]
    assert last.finish_reason == "stop" and last.text == full.text[: full.text.find(stop)]
    assert [o.token_ids for o in delta] == [o.delta_token_ids for o in cumulative]
    assert [o.text for o in delta] == [o.delta_text for o in cumulative]
    assert sum((o.token_ids for o in delta), []) == last.token_ids and "".join(o.text for o in delta) == last.text
    assert sum((o.logprobs for o in delta), []) == last.logprobs
    assert sum((o.top_logprobs for o in delta), []) == last.top_logprobs
    assert len(final) == 1 and final[0].finished
    assert (final[0].token_ids, final[0].text, final[0].logprobs) == (last.token_ids, last.text, last.logprobs)


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="partial")
