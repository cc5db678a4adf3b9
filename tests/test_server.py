"""The OpenAI-compatible server, over real HTTP on 127.0.0.1, with a tiny random model.

One tiny model (SmolLM2's tokenizer, random weights) saved as an orbax directory and loaded
by path, like `jaxinfer serve --model DIR` does. Every server here has the same engine
shapes, so the two step programs are compiled once for the whole file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import re
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

import jaxinfer
from jaxinfer.checkpoint import save_orbax
from jaxinfer.speculative import DraftModel
from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.loading import load_model
from jaxinfer.sampling import SamplingParams
from jaxinfer.scoring import score_tokens
from jaxinfer.server.serve import DrainingServer, build_server
from jaxinfer.tokenizer import Tokenizer
from test_model_parity import all_position_logits
from tiny_models import tiny_model

NAME = "tiny"
KEY = "sk-test"
T = 120  # seconds an HTTP call may take (the first request compiles; the machine may be busy)
MAX_LEN = 64
# page_size 16 at max_model_len 64: 4 pages per sequence, one context bucket, two programs.
# Wide batches keep the step count (the cost on a busy CPU) low.
ENGINE = EngineConfig(max_slots=16, page_size=16, prefill_chunk=16, max_prefill_rows=4, max_model_len=MAX_LEN)


class ServerThread:
    """uvicorn serving an `OpenAIServer` in a thread, on a free port of 127.0.0.1."""

    def __init__(self, server, grace_s: float = T):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = server
        self.uvicorn = DrainingServer(server, "127.0.0.1", self.port, grace_s, log_level="warning")
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.uvicorn.should_exit = True  # what uvicorn's SIGTERM / SIGINT handler does
        self.thread.join(T)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def wait_idle(self, timeout: float = 30) -> None:
        """Until nothing is outstanding (the engine loop has applied every abort)."""
        deadline = time.monotonic() + timeout
        while self.metric("jaxinfer_requests_outstanding") or self.metric("jaxinfer_requests_running"):
            assert time.monotonic() < deadline, "requests still outstanding"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def model(smollm2_gguf, tmp_path_factory):
    tok = Tokenizer.from_gguf(smollm2_gguf)
    config, params = tiny_model(vocab_size=tok.vocab_size, eos_ids=tok.eos_ids, max_position=MAX_LEN)
    path = save_orbax(config, params, tmp_path_factory.mktemp("tiny") / "model", tokenizer=tok)
    return load_model(path)


@pytest.fixture(scope="module")
def srv(model):
    s = ServerThread(build_server(model, ENGINE, NAME, max_queue=256, warmup=False))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small(model):
    """With an API key and no queue beyond the 8 slots."""
    s = ServerThread(build_server(model, ENGINE, NAME, api_key=KEY, max_queue=0, warmup=False))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=T)


def engine_text(model, ids, params) -> str:
    eng = Engine(model, ENGINE)
    return eng.generate([ids], params)[0].text


def test_health_and_models(srv, client):
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [NAME]
    card = client.models.retrieve(NAME)
    assert card.id == NAME and time.time() - 3600 < card.created <= time.time()  # a Unix time: when it was loaded
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert httpx.get(f"{srv.url}/version").json() == {"version": jaxinfer.__version__}


def test_continue_final_message(srv, client, model):
    """vLLM's chat extras: `continue_final_message` continues a prefilled assistant answer
    (rendered as transformers cuts it, no turn opened), equal to the engine's greedy answer to
    that text; `/tokenize` renders the same; `chat_template_kwargs` reach the template."""
    tok = model.tokenizer
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True),
                     add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nMy favourite is")
    want = engine_text(model, ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    extra = {"continue_final_message": True, "ignore_eos": True, "chat_template_kwargs": {"unused_flag": True}}
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    rendered = httpx.post(f"{srv.url}/tokenize", json={"messages": messages, "continue_final_message": True}).json()
    assert rendered["tokens"] == ids
    for body, param in [({"continue_final_message": True, "add_generation_prompt": True}, "messages"),
                        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs")]:
        err = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": NAME, "messages": messages} | body, timeout=T)
        assert err.status_code == 400 and err.json()["error"]["param"] == param, (body, err.text)


def test_tokenize_and_detokenize(srv, model):
    """vLLM's /tokenize and /detokenize: the ids a prompt or chat is served with, and back."""
    tok = model.tokenizer
    r = httpx.post(f"{srv.url}/tokenize", json={"model": NAME, "prompt": "Hello there", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello there") and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_LEN
    assert r["token_strs"] == [tok.id_to_token(i) for i in r["tokens"]]
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{srv.url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert chat["token_strs"] is None
    back = httpx.post(f"{srv.url}/detokenize", json={"model": NAME, "tokens": r["tokens"]}).json()
    assert back == {"prompt": tok.decode(r["tokens"])}
    rendered = httpx.post(f"{srv.url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered == tok.apply_chat_template(messages) and rendered.startswith("<|im_start|>")  # special tokens stay
    bare = httpx.post(f"{srv.url}/detokenize", json={"tokens": chat["tokens"], "skip_special_tokens": True}).json()
    assert bare["prompt"] == tok.decode(chat["tokens"]) and "<|im_start|>" not in bare["prompt"]
    for path, body, param in [("/tokenize", {"model": NAME}, "prompt"), ("/detokenize", {"tokens": [10**7]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        err = httpx.post(f"{srv.url}{path}", json=body)
        assert err.status_code == 400 and err.json()["error"]["param"] == param, (path, body, err.text)
    err = httpx.post(f"{srv.url}/tokenize", json={"model": "gpt-9", "prompt": "x"})
    assert err.status_code == 404 and err.json()["error"]["code"] == "model_not_found"


def test_completion_greedy_equals_engine(srv, client, model):
    prompt = "The quick brown fox"
    want = engine_text(model, model.tokenizer.encode(prompt), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    extra = {"ignore_eos": True}
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(model.tokenizer.encode(prompt)), 12)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])  # without continuous_usage_stats: the last chunk only
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body=extra))
    counts = [c.usage.completion_tokens for c in chunks]  # every chunk carries the usage so far
    assert counts == sorted(counts) and counts[-1] == counts[-2] == 12 and counts[0] < 12


def test_chat_greedy_equals_engine(srv, client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    want = engine_text(model, ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    kw = dict(model=NAME, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    # vLLM's continuous_usage_stats: every chunk carries the usage so far, ending at the total
    chunks = list(client.chat.completions.create(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **kw))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 10
    assert {c.usage.prompt_tokens for c in chunks} == {len(ids)}


def test_raw_sse_format(srv):
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=T) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_seed_n_stop(client):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=7, n=2,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: repeats exactly
    assert [c.index for c in a.choices] == [0, 1] and a.usage.completion_tokens == 20
    assert a.choices[0].text != a.choices[1].text  # choice i samples with seed + i
    streamed = ["", ""]
    for c in client.completions.create(stream=True, **kw):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == [c.text for c in a.choices]
    full = a.choices[0].text
    stop = full.strip().split()[1]  # a word in the middle of the seeded output
    cut = client.completions.create(**(kw | {"n": 1, "stop": [stop]}))
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].stop_reason == stop and a.choices[0].stop_reason is None  # vLLM's: which stop ended it
    kept = client.completions.create(**(kw | {"n": 1, "stop": [stop], "extra_body": {"ignore_eos": True,
                                                                                   "include_stop_str_in_output": True}}))
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]


BAD = [
    ({"content": b"{not json", "headers": {"content-type": "application/json"}}, None, "/v1/completions"),
    ({"content": b'{"prompt": "\xff\xfe"}', "headers": {"content-type": "application/json"}}, None,
     "/v1/completions"),  # not UTF-8
    ({"content": b'{"prompt": "x"}', "headers": {"content-type": "application/x-www-form-urlencoded"}}, None,
     "/v1/completions"),  # what `curl -d` sends without -H
    ({"json": {"model": NAME, "prompt": "x", "stream_options": {"include_usage": True}}}, "stream_options",
     "/v1/completions"),
    ({"json": {"model": NAME}}, "prompt", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "max_tokens": "many"}}, "max_tokens", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "top_p": 1.5}}, "top_p", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "temperature": -1}}, "temperature", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "max_tokens": 0}}, "max_tokens", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "n": 0}}, "n", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "word " * MAX_LEN}}, "prompt", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "max_tokens": MAX_LEN}}, "max_tokens", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": [10**6]}}, "prompt", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "logprobs": 21}}, "logprobs", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "logprobs": -1}}, "logprobs", "/v1/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}},
     "top_logprobs", "/v1/chat/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}}, "top_logprobs",
     "/v1/chat/completions"),
    ({"json": {"model": NAME, "prompt": "x", "frequency_penalty": 2.5}}, "frequency_penalty", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "repetition_penalty": 0}}, "repetition_penalty", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "logit_bias": {"12": 150}}}, "logit_bias", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "logit_bias": {"a": 1}}}, "logit_bias", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "logit_bias": {"99999999": 1}}}, "logit_bias", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "max_tokens": 4, "min_tokens": 5}}, "min_tokens", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "min_tokens": -1}}, "min_tokens", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "def f(", "suffix": "return x"}}, "suffix", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "best_of": 3}}, "best_of", "/v1/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}},
     "response_format", "/v1/chat/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}},
     "response_format.type", "/v1/chat/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "objekt"}}}}}, "response_format",
     "/v1/chat/completions"),
    ({"json": {"model": NAME, "prompt": "x", "guided_regex": "[a-z"}}, "guided_regex", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}},
     "structured_outputs", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": "x", "response_format": {"type": "json_object"}, "guided_choice": ["a"]}},
     "response_format", "/v1/completions"),
    ({"json": {"model": NAME, "messages": []}}, "messages", "/v1/chat/completions"),
    ({"json": {"model": NAME, "prompt": "x", "stop": 5}}, "stop", "/v1/completions"),
    ({"json": {"model": NAME, "prompt": None}}, "prompt", "/v1/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "user"}]}}, "messages.0", "/v1/chat/completions"),
    ({"json": {"model": NAME, "prompt": "x", "truncate_prompt_tokens": 0}}, "truncate_prompt_tokens", "/v1/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}},
     "messages.1", "/v1/chat/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}}, "messages.0.role",
     "/v1/chat/completions"),
    ({"json": {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}},
     "messages.0.content", "/v1/chat/completions"),
]


def test_model_names(srv, client, model):
    """The model may be left out (vLLM's leniency: the served one); an unknown one is a 404
    `model_not_found` for every endpoint, as OpenAI and vLLM answer it; several served names."""
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=T)
    assert r.status_code == 200 and r.json()["model"] == NAME
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        err = httpx.post(f"{srv.url}{path}", json=body | {"model": "gpt-9"}, timeout=T)
        assert err.status_code == 404, err.text
        assert err.json()["error"] | {"message": None} == {"message": None, "type": "invalid_request_error",
                                                           "param": "model", "code": "model_not_found"}
    two = ServerThread(build_server(model, ENGINE, [NAME, "alias"], max_queue=4, warmup=False))
    try:
        assert [m["id"] for m in httpx.get(f"{two.url}/v1/models").json()["data"]] == [NAME, "alias"]
        r = httpx.post(f"{two.url}/v1/completions", json={"model": "alias", "prompt": "Hi", "max_tokens": 1}, timeout=T)
        assert r.status_code == 200 and r.json()["model"] == "alias"
    finally:
        two.stop()


def test_batch_of_prompts(srv, client, model):
    """A completion request with a list of prompts (texts or token-id lists): choice
    p * n + j is prompt p's j-th choice, each equal to the engine's answer to that prompt
    alone; usage counts every prompt once; one bad prompt refuses the whole batch."""
    tok = model.tokenizer
    texts = ["The quick brown fox", "Once upon", "A"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [engine_text(model, tok.encode(t), params) for t in texts]
    kw = dict(model=NAME, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=texts, n=2, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [w for w in want for _ in range(2)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(len(tok.encode(t)) for t in texts), 36)
    by_ids = client.completions.create(prompt=[tok.encode(t) for t in texts], **kw)
    assert [c.text for c in by_ids.choices] == want
    streamed = [""] * 3
    for c in client.completions.create(prompt=texts, stream=True, **kw):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == want
    echo = client.completions.create(prompt=texts[:2], echo=True, **kw)
    assert [c.text for c in echo.choices] == [texts[0] + want[0], texts[1] + want[1]]
    ids = [tok.encode(t) for t in texts[:2]]
    echo = client.completions.create(prompt=ids, echo=True, **kw)  # the ids' text, special tokens included
    assert [c.text for c in echo.choices] == [tok.decode(i, skip_special_tokens=False) + w for i, w in zip(ids, want)]
    more_than_held = ["x"] * (ENGINE.max_slots + 256 + 1)  # srv: max_queue 256; no retry could serve it (not a 429)
    for bad in (["fine", ""], ["fine", "word " * MAX_LEN], [[1, 2], [10**6]], more_than_held):
        err = httpx.post(f"{srv.url}/v1/completions", json={"model": NAME, "prompt": bad, "max_tokens": 2}, timeout=T)
        assert err.status_code == 400 and err.json()["error"]["param"] == "prompt", (bad, err.text)
    srv.wait_idle()


UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_unit", "description": "Pick a unit", "parameters": UNIT}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                           "additionalProperties": False}}}]


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None]:
    """Tool calls reassembled from streamed deltas (as OpenAI clients do), and the finish reason."""
    calls, finish = {}, None
    for c in stream:
        for t in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(t.index, {"name": None, "arguments": ""})
            call["name"] = t.function.name or call["name"]
            call["arguments"] += t.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return calls, finish


def client_text(srv, ids: list[int]) -> str:
    return httpx.post(f"{srv.url}/detokenize", json={"tokens": ids}).json()["prompt"]


def test_tool_calls(srv, client):
    """tool_choice naming a function or "required": the answer is constrained to a call of
    the listed tools and comes back as `tool_calls` (streamed as deltas); tools that cannot
    be served are a 400 naming the field; a conversation holding earlier calls
    and a tool's answer renders. "auto" answers in text (no parser of free-form calls)."""
    messages = [{"role": "user", "content": "Which unit?"}]
    kw = dict(model=NAME, messages=messages, tools=TOOLS, max_tokens=18, temperature=0)  # the context is 64
    named = {"type": "function", "function": {"name": "set_unit"}}
    r = client.chat.completions.create(tool_choice=named, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "set_unit"
    assert json.loads(call.function.arguments) in ({"unit": "c"}, {"unit": "f"})
    calls, finish = _streamed_calls(client.chat.completions.create(tool_choice=named, stream=True, **kw))
    assert calls == {0: {"name": "set_unit", "arguments": call.function.arguments}} and finish == "stop"
    stopped = client.chat.completions.create(tool_choice=named, stop=['"', "unit"], **kw)  # a forced call is whole
    assert stopped.choices[0].message.tool_calls[0].function.arguments == call.function.arguments

    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) in (
        [("set_unit", {"unit": u}) for u in "cf"] + [("ping", {})])
    calls, finish = _streamed_calls(client.chat.completions.create(tool_choice="required", parallel_tool_calls=False,
                                                                   stream=True, **kw))
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
    assert finish == "tool_calls"
    for cut in (2, 7):  # cut short by max_tokens: the calls as far as written, streamed or not
        short = kw | {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": cut}
        r = client.chat.completions.create(**short)
        calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **short))
        assert r.choices[0].finish_reason == finish == "length" and r.choices[0].message.content is None
        assert {i: {"name": c.function.name, "arguments": c.function.arguments}
                for i, c in enumerate(r.choices[0].message.tool_calls or [])} == calls

    text = client.chat.completions.create(tool_choice="none", **kw)
    assert text.choices[0].message.tool_calls is None and text.choices[0].finish_reason in ("stop", "length")
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "set_unit", "arguments": '{"unit":"c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = client.chat.completions.create(**(kw | {"messages": history, "tool_choice": "none", "max_tokens": 2}))
    rendered = httpx.post(f"{srv.url}/tokenize", json={"messages": history}).json()
    assert r.usage.prompt_tokens == rendered["count"] and "done" in client_text(srv, rendered["tokens"])

    auto = client.chat.completions.create(**(kw | {"tool_choice": "auto"}))  # no parser: the answer is text
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content == text.choices[0].message.content
    for body, param in [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
                        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
                        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice")]:
        err = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": NAME, "messages": messages} | body, timeout=T)
        assert err.status_code == 400 and err.json()["error"]["param"] == param, (body, err.text)


def test_the_models_generation_config_sets_the_defaults_of_fields_left_out(model, tmp_path):
    """vLLM's `--generation-config`: "auto" (the default) fills the fields a request leaves out
    from the model's generation_config.json (here greedy, at most 5 tokens); what the request
    sends wins; "vllm" keeps the API's own defaults (temperature 1, 16 tokens); a directory
    brings its own; anything else is refused by name."""
    recommended = dataclasses.replace(model, generation_config={"temperature": 0.0, "top_k": 40, "max_tokens": 5})
    ids = model.tokenizer.encode("Once upon a time")
    greedy = Engine(model, ENGINE).generate([ids], SamplingParams(temperature=0, max_tokens=5))[0].text
    body = {"model": NAME, "prompt": ids, "ignore_eos": True}
    s = ServerThread(build_server(recommended, ENGINE, NAME, warmup=False))
    try:
        auto = httpx.post(f"{s.url}/v1/completions", json=body, timeout=T).json()
        assert auto["choices"][0]["text"] == greedy and auto["usage"]["completion_tokens"] == 5
        sent = httpx.post(f"{s.url}/v1/completions", json=body | {"max_tokens": 7, "temperature": 1.0, "seed": 3},
                          timeout=T).json()
        assert sent["usage"]["completion_tokens"] == 7
    finally:
        s.stop()
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "do_sample": True}))
    for config, tokens in (("vllm", 16), (str(tmp_path), 3)):
        s = ServerThread(build_server(recommended, ENGINE, NAME, warmup=False, generation_config=config))
        try:
            assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=T).json()["usage"]["completion_tokens"] == tokens
        finally:
            s.stop()
    with pytest.raises(ValueError, match="generation_config='nowhere' must be 'auto', 'vllm' or a directory"):
        build_server(model, ENGINE, NAME, warmup=False, generation_config="nowhere")


def test_a_forced_tool_call_may_think_first(model):
    """With a reasoning parser (here the engine config's), a forced call's grammar starts after
    the thinking, and the thinking comes back as `reasoning_content` beside the calls, here
    DeepSeek-R1's, which the tiny model never closes: all reasoning, no call, cut by length.
    A server and an engine config naming different parsers are refused."""
    s = ServerThread(build_server(model, dataclasses.replace(ENGINE, reasoning_parser="deepseek_r1"), NAME, warmup=False))
    try:
        thinker = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=T)
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Which unit?"}], tools=TOOLS, max_tokens=6,
                  temperature=0, tool_choice="required")
        r = thinker.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and msg.tool_calls is None and msg.content is None
        assert msg.reasoning_content and r.usage.completion_tokens_details.reasoning_tokens == 6
        calls, finish = _streamed_calls(thinker.chat.completions.create(stream=True, **kw))
        assert calls == {} and finish == "length"
    finally:
        s.stop()
    with pytest.raises(ValueError, match="reasoning_parser='qwen3' differs from the engine config's 'deepseek_r1'"):
        build_server(model, dataclasses.replace(ENGINE, reasoning_parser="deepseek_r1"), NAME, warmup=False,
                     reasoning_parser="qwen3")


def test_reasoning_parser_splits_the_thinking_from_the_answer(model, client):
    """`reasoning_parser="qwen3"` (vLLM's `--reasoning-parser`): a chat answer's <think>...</think>
    comes back as `reasoning_content` (and `reasoning`), the rest as content, streamed or not;
    `include_reasoning: false` drops it; a server without a parser keeps the text as it is. The
    tiny model is made to think by a choice constraint."""
    s = ServerThread(build_server(model, ENGINE, NAME, warmup=False, reasoning_parser="qwen3"))
    try:
        thinker = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=T)
        answer = "<think>Two and two.\n</think>\n\nFour."
        kw = dict(model=NAME, messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=24, temperature=0,
                  extra_body={"structured_outputs": {"choice": [answer]}})
        answered = thinker.chat.completions.create(**kw, logprobs=True)
        msg, tokens = answered.choices[0].message, [t.token for t in answered.choices[0].logprobs.content]
        assert (msg.content, msg.reasoning_content, msg.reasoning) == ("\n\nFour.", "Two and two.\n", "Two and two.\n")
        n = answered.usage.completion_tokens_details.reasoning_tokens  # the thinking's tokens, tags included
        assert "</think>" in "".join(tokens[:n]) and "</think>" not in "".join(tokens[: n - 1]) and n < len(tokens)
        reasoning = content = ""
        for c in thinker.chat.completions.create(stream=True, **kw):
            if c.choices:
                reasoning += getattr(c.choices[0].delta, "reasoning_content", None) or ""
                content += c.choices[0].delta.content or ""
        assert (reasoning, content) == ("Two and two.\n", "\n\nFour.")
        dropped = httpx.post(f"{s.url}/v1/chat/completions", timeout=T,
                             json={**{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"],
                                   "include_reasoning": False}).json()["choices"][0]["message"]
        assert dropped["content"] == "\n\nFour." and "reasoning_content" not in dropped
        plain = thinker.chat.completions.create(**dict(kw, extra_body={"structured_outputs": {"choice": ["No tags."]}}))
        assert plain.choices[0].message.content == "No tags." and plain.choices[0].message.reasoning_content is None
        cut = thinker.chat.completions.create(**dict(kw, max_tokens=7)).choices[0]  # cut short while thinking
        assert cut.finish_reason == "length" and cut.message.content is None and cut.message.reasoning_content
        # the Responses API: a reasoning item before the message, streamed as reasoning_text events
        ask = {"model": NAME, "input": "2 + 2?", "max_output_tokens": 24, "temperature": 0,
               "structured_outputs": {"choice": [answer]}}
        responded = httpx.post(f"{s.url}/v1/responses", json=ask, timeout=T).json()
        output = responded["output"]
        assert [item["type"] for item in output] == ["reasoning", "message"]
        assert responded["usage"]["output_tokens_details"]["reasoning_tokens"] == n
        assert output[0]["content"][0]["text"] == "Two and two.\n" and output[1]["content"][0]["text"] == "\n\nFour."
        with httpx.stream("POST", f"{s.url}/v1/responses", json=ask | {"stream": True}, timeout=T) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Two and two.\n"
        assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "message"]
        assert events[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == n
        assert client.chat.completions.create(**kw).choices[0].message.content == answer  # no parser: as written
        with pytest.raises(ValueError, match="reasoning_parser"):
            build_server(model, ENGINE, NAME, warmup=False, reasoning_parser="granite")
        refused = httpx.post(f"{s.url}/v1/chat/completions", timeout=T,
                             json={"model": NAME, "messages": kw["messages"], "chat_template": "{{ 'X' }}"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    finally:
        s.stop()


def test_auto_tool_calls_parsed_from_the_answer(model, client):
    """With `tool_call_parser="hermes"` (or "llama3_json"), tool choice "auto" returns the calls
    the model writes (`<tool_call>{json}</tool_call>`) as `tool_calls`, streamed or not, and the rest as content;
    an answer without calls is plain text. The tiny model is made to write one by a choice
    constraint."""
    s = ServerThread(build_server(model, ENGINE, NAME, warmup=False, tool_call_parser="hermes"))
    try:
        hermes = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=T)
        answer = 'On it.\n<tool_call>{"name":"set_unit","arguments":{"unit":"c"}}</tool_call>\n'
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Unit?"}], tools=TOOLS, max_tokens=32,
                  temperature=0, extra_body={"structured_outputs": {"choice": [answer]}})
        r = hermes.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content == "On it."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("set_unit", {"unit": "c"})]
        assert msg.tool_calls[0].id.startswith("call_")
        calls, finish = _streamed_calls(hermes.chat.completions.create(stream=True, **kw))
        stream = hermes.chat.completions.create(stream=True, **kw)
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert content == "On it." and finish == "tool_calls"  # the whitespace around the call: not content
        assert calls == {0: {"name": "set_unit", "arguments": msg.tool_calls[0].function.arguments}}
        # parallel_tool_calls false: the first call the model wrote, streamed or not
        two = dict(kw, max_tokens=32, parallel_tool_calls=False, extra_body={"structured_outputs": {"choice": [
            '<tool_call>{"name":"a","arguments":{}}</tool_call><tool_call>{"name":"b","arguments":{}}</tool_call>']}})
        assert [c.function.name for c in hermes.chat.completions.create(**two).choices[0].message.tool_calls] == ["a"]
        assert [c["name"] for c in _streamed_calls(hermes.chat.completions.create(stream=True, **two))[0].values()] == ["a"]
        both = hermes.chat.completions.create(**(two | {"parallel_tool_calls": True})).choices[0].message.tool_calls
        assert [c.function.name for c in both] == ["a", "b"]
        # no call in the answer, or tool choice "none": text, as the server without a parser gives it
        plain = dict(kw, extra_body={"structured_outputs": {"choice": ["<tool_call> is a tag"]}})
        for extra in ({}, {"tool_choice": "none"}):
            r = hermes.chat.completions.create(**plain, **extra)
            assert r.choices[0].message.content == "<tool_call> is a tag" and r.choices[0].message.tool_calls is None
        text = client.chat.completions.create(**kw)  # the server without a parser: the call stays text
        assert text.choices[0].message.content == answer and text.choices[0].message.tool_calls is None
        with pytest.raises(ValueError, match="tool_call_parser"):
            build_server(model, ENGINE, NAME, warmup=False, tool_call_parser="mistral")
    finally:
        s.stop()
    s = ServerThread(build_server(model, ENGINE, NAME, warmup=False, tool_call_parser="llama3_json"))
    try:  # Llama 3's JSON calls: the whole answer is the call
        llama = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=T)
        answer = '{"name": "set_unit", "parameters": {"unit": "f"}}'
        kw |= {"extra_body": {"structured_outputs": {"choice": [answer]}}}
        r = llama.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [
            ("set_unit", '{"unit": "f"}')]
        calls, finish = _streamed_calls(llama.chat.completions.create(stream=True, **kw))
        assert calls == {0: {"name": "set_unit", "arguments": '{"unit": "f"}'}} and finish == "tool_calls"
    finally:
        s.stop()


def test_responses_api(srv, client):
    """`/v1/responses` (OpenAI's Responses API) answers as chat does for the same conversation:
    text, streamed events, a format, function calls, earlier calls in the input; what it
    cannot serve is a 400 naming the field."""
    kw = dict(model=NAME, input="Hello there", instructions="Be brief.", max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=NAME, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    r = client.responses.create(**kw)
    assert r.output_text == chat.choices[0].message.content and r.id.startswith("resp_") and r.output[0].id.startswith("msg_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # chat: "length"
    assert r.output[0].status == "incomplete" and r.model_dump()["completed_at"] is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].content[0].text == r.output_text
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))  # from 0, as OpenAI counts
    with client.responses.stream(**(kw | {"max_output_tokens": 20}), extra_body={"guided_choice": ["yes", "no"]}) as s:
        final = s.get_final_response()  # vLLM's extras pass through to the chat request
    assert final.status == "completed" and final.output_text in ("yes", "no") and final.output[0].status == "completed"
    assert final.model_dump()["completed_at"] >= final.created_at
    # logprobs: chat's, per output token (streamed with each delta too)
    chat_lp = client.chat.completions.create(model=NAME, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                             messages=[{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hello there"}])
    want = [c.model_dump() for c in chat_lp.choices[0].logprobs.content]
    r = client.responses.create(top_logprobs=2, include=["message.output_text.logprobs"], **kw)
    assert [lp.model_dump() for lp in r.output[0].content[0].logprobs] == want and len(want) == 8
    events = list(client.responses.create(stream=True, top_logprobs=2, **kw))
    assert [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs] == want
    assert client.responses.create(**kw).output[0].content[0].logprobs == []  # not asked for

    unit = {"type": "function", "name": "set_unit", "parameters": UNIT}
    calls = dict(model=NAME, input="Unit?", tools=[unit], max_output_tokens=30, temperature=0, parallel_tool_calls=False)
    r = client.responses.create(tool_choice="required", **calls)
    assert [(o.type, o.name, json.loads(o.arguments)["unit"] in "cf") for o in r.output] == [
        ("function_call", "set_unit", True)] and r.output[0].call_id.startswith("call_")
    named = client.responses.create(tool_choice={"type": "function", "name": "set_unit"}, stream=True, **calls)
    pieces = [e for e in named if e.type.startswith("response.function_call_arguments")]
    assert "".join(e.delta for e in pieces[:-1]) == pieces[-1].arguments == r.output[0].arguments
    history = [{"role": "user", "content": "Unit?"},
               {"type": "function_call", "call_id": "c1", "name": "set_unit", "arguments": '{"unit":"c"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "done"}]
    r = client.responses.create(model=NAME, input=history, max_output_tokens=2, temperature=0)
    rendered = httpx.post(f"{srv.url}/tokenize", json={"messages": [
        history[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "set_unit", "arguments": '{"unit":"c"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]}).json()
    assert r.usage.input_tokens == rendered["count"]
    for bad, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                        "input.0.content.0"),
                       ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
                       ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
                       ({"input": [{"type": "reasoning", "content": "x"}]}, "input.0"),
                       ({"input": "x " * 400}, "input"), ({"max_output_tokens": 10**5}, "max_output_tokens"),
                       ({"text": {"format": {"type": "xml"}}}, "text.format"), ({"input": [{"role": "robot"}]}, "input"),
                       ({"max_output_tokens": 0}, "max_output_tokens"), ({"model": "nope"}, "model"),
                       ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
                       ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input.0")]:
        err = httpx.post(f"{srv.url}/v1/responses", json={"model": NAME, "input": "x"} | bad, timeout=T)
        assert err.status_code in (400, 404) and err.json()["error"]["param"] == param, (bad, err.text)
        assert not re.search(r"\b(max_tokens|messages)\b", err.json()["error"]["message"]), err.text  # chat's names


def test_responses_are_stored_and_continued(srv, client):
    """A stored response continues with `previous_response_id` exactly as its conversation sent
    whole would (its instructions not carried over), and is found, listed and deleted by id."""
    kw = dict(model=NAME, max_output_tokens=3, temperature=0)
    first = client.responses.create(input="I am Ada.", instructions="Be brief.", **kw)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(input="Who?", previous_response_id=first.id, **kw)
    whole = client.responses.create(input=[{"role": "user", "content": "I am Ada."},
                                           *[item.model_dump() for item in first.output],
                                           {"role": "user", "content": "Who?"}], store=False, **kw)
    assert second.previous_response_id == first.id and second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [item.content[0].text for item in listed.data] == ["I am Ada.", first.output_text, "Who?"]
    newest = client.responses.input_items.list(second.id, limit=2)  # desc by default; pages follow `after`
    assert [i.id for i in newest.data] == [i.id for i in listed.data][::-1][:2] and newest.has_more
    assert [i.id for i in newest] == [i.id for i in listed.data][::-1]
    short = kw | {"instructions": "."}  # (in place of the template's long default system prompt)
    streamed = list(client.responses.create(input="More.", previous_response_id=second.id, stream=True, **short))[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    assert len(client.responses.input_items.list(streamed.id).data) == 5  # 3 inputs, 1 output, "More."
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)  # store false
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="Hi", previous_response_id=first.id, **kw)
    assert e.value.body["param"] == "previous_response_id"
    again = client.responses.create(input="More.", previous_response_id=second.id, **short)  # its history is its own
    assert again.output_text == streamed.output_text


def test_a_stored_response_is_kept_from_its_start(srv, client):
    """OpenAI's stored responses: `in_progress` while generating; a client that leaves
    mid-stream leaves it `cancelled`, as far as it got; a streamed GET is a 400."""
    body = {"model": NAME, "input": "Count to fifty", "instructions": ".", "max_output_tokens": 40, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{srv.url}/v1/responses", json=body, timeout=T) as r:
        lines = r.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data: {"))[len("data: "):])
        response_id = created["response"]["id"]
        next(line for line in lines if '"response.output_text.delta"' in line)
        assert client.responses.retrieve(response_id).status == "in_progress"
    srv.wait_idle()  # leaving the block closed the connection mid-stream
    left = client.responses.retrieve(response_id)
    assert left.status == "cancelled" and left.output_text and srv.metric("jaxinfer_kv_pages_used") == 0
    err = httpx.get(f"{srv.url}/v1/responses/{response_id}", params={"stream": "true"}, timeout=T)
    assert err.status_code == 400 and err.json()["error"]["param"] == "stream"


def _settled(client, response_id: str):
    """A background response once it has left "queued" / "in_progress"."""
    deadline = time.monotonic() + T
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "a background response never finished"
        time.sleep(0.05)
    return r


def test_background_responses_are_polled_and_cancelled(srv, client):
    """OpenAI's background mode: the POST answers "queued" at once, the stored response reads
    "in_progress" until it holds what a plain request answers; `cancel` stops one (its pages
    freed); what cannot run is a 400 from the POST itself."""
    kw = dict(model=NAME, input="Hello there", instructions=".", max_output_tokens=6, temperature=0)
    queued = client.responses.create(background=True, **kw)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = _settled(client, queued.id)
    plain = client.responses.create(**kw)
    assert (done.id, done.created_at, done.background) == (queued.id, queued.created_at, True)
    assert done.status == plain.status == "incomplete" and done.output_text == plain.output_text
    assert done.usage.output_tokens == plain.usage.output_tokens
    assert client.responses.cancel(done.id).status == "incomplete"  # finished: as it is
    # a long one cancelled while it runs
    long = client.responses.create(background=True, **(kw | {"max_output_tokens": 40}), extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="More", previous_response_id=long.id, model=NAME)  # not finished yet
    assert e.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    srv.wait_idle()  # its request was aborted, and what it had written is not kept
    assert client.responses.retrieve(long.id).model_dump()["status"] == "cancelled"
    for bad, param in [({"store": False}, "background"), ({"stream": True}, "stream"),
                       ({"max_output_tokens": 10**5}, "max_output_tokens"), ({"model": "nope"}, "model")]:
        err = httpx.post(f"{srv.url}/v1/responses", json={"model": NAME, "input": "x", "background": True} | bad, timeout=T)
        assert err.status_code in (400, 404) and err.json()["error"]["param"] == param, (bad, err.text)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)  # not a background response


def test_usage_counts_the_prompt_tokens_the_prefix_cache_spared(srv, client):
    """`usage.prompt_tokens_details.cached_tokens` (OpenAI's field) is what the prefix cache
    spared: none of a prompt seen first, its full pages but the last one's the second time;
    streamed, completions with n choices (the prompt counted once) and Responses too."""
    prompt = "Cached prompt: " + " ".join(["seven"] * 24)  # > 2 pages of 16 tokens
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, n=2, temperature=0)
    # its full pages, but the one holding the last prompt token (always recomputed)
    assert again.usage.prompt_tokens_details.cached_tokens == 16 * ((first.usage.prompt_tokens - 1) // 16) > 0
    messages = [{"role": "user", "content": prompt[:60]}]
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    # (the template's system prompt opens every chat: its page may be cached by earlier requests)
    assert first.usage.prompt_tokens_details.cached_tokens < 16 * ((first.usage.prompt_tokens - 1) // 16)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, stream=True,
                                                 stream_options={"include_usage": True}))
    hit = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert hit == 16 * ((first.usage.prompt_tokens - 1) // 16) > 0
    r = client.responses.create(model=NAME, input=prompt[:60], max_output_tokens=1, store=False)
    assert r.usage.input_tokens_details.cached_tokens == hit
    # tenants: `cache_salt`, else `user`, each its own namespace
    tenant = "Tenant prompt: " + " ".join(["eight"] * 24)
    for fields, cached in [({"user": "alice"}, False), ({"user": "alice"}, True), ({"cache_salt": "alice"}, False),
                           ({"cache_salt": "alice"}, True), ({}, False)]:
        r = client.completions.create(model=NAME, prompt=tenant, max_tokens=1, temperature=0, extra_body=fields)
        assert (r.usage.prompt_tokens_details.cached_tokens > 0) == cached, fields


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, model):
    """vLLM's `truncate_prompt_tokens`: only the prompt's last k tokens are read."""
    ids = model.tokenizer.encode("one two three four five six seven eight nine ten " * 6)
    kw = dict(model=NAME, max_tokens=4, temperature=0)
    cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 12}, **kw)
    assert cut.usage.prompt_tokens == 12 and cut.choices[0].text == client.completions.create(prompt=ids[-12:], **kw).choices[0].text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x " * 100}], **kw,
                                          extra_body={"truncate_prompt_tokens": 20})  # would not fit whole
    assert chat.usage.prompt_tokens == 20


def test_default_max_tokens_fits_the_context(srv, model):
    """Completions' default max_tokens (16, OpenAI's) is cut to what the context has left; a
    max_tokens the client sent that does not fit is a 400 `context_length_exceeded`."""
    ids = list(range(100, 100 + MAX_LEN - 5))
    body = {"model": NAME, "prompt": ids, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=T).json()
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
    assert httpx.post(f"{srv.url}/v1/completions", json={"model": NAME, "prompt": "x", "ignore_eos": True},
                      timeout=T).json()["usage"]["completion_tokens"] == 16
    err = httpx.post(f"{srv.url}/v1/completions", json=body | {"max_tokens": 6}, timeout=T).json()["error"]
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")


def test_bad_words_extra(client):
    """vLLM's `bad_words` extra: the word the model would write next is never written."""
    kw = dict(model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0)
    word = client.completions.create(**kw).choices[0].text.split()[0]
    avoided = client.completions.create(**kw, extra_body={"bad_words": [word]}).choices[0].text
    assert word not in avoided.split()


def test_null_means_the_default(client):
    """OpenAI's SDK sends `null` for a parameter given as None; like OpenAI and vLLM, the
    server reads it as the parameter's default (a seeded sample at temperature 1, top_p 1)."""
    msgs = [{"role": "user", "content": "Name a colour."}]
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, logprobs=None, frequency_penalty=None,
                 presence_penalty=None, stream_options=None, response_format=None)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, seed=3, **nulls)
    plain = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, seed=3)
    assert [c.message.content for c in r.choices] == [plain.choices[0].message.content] and r.choices[0].logprobs is None
    echo = client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0, echo=None, best_of=None)
    assert echo.choices[0].text == client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_skip_special_tokens(client):
    """vLLM's `skip_special_tokens`: special tokens leave the text unless it is False (the
    model is pushed to write `<|im_start|>`, id 1, by logit bias)."""
    kw = dict(model=NAME, prompt="Hi", max_tokens=4, temperature=0, logit_bias={"1": 100})
    assert client.completions.create(**kw).choices[0].text == ""
    text = client.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0].text
    assert text == "<|im_start|>" * 4
    streamed = client.completions.create(**kw, stream=True, extra_body={"skip_special_tokens": False})
    assert "".join(c.choices[0].text for c in streamed) == text


def test_errors_have_openai_shape_and_disturb_nothing(srv, model):
    body = {"model": NAME, "prompt": "In flight", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    want = engine_text(model, model.tokenizer.encode("In flight"), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=T) as inflight:
        for kwargs, param, path in BAD:
            r = httpx.post(f"{srv.url}{path}", **kwargs)
            assert r.status_code == 400, (kwargs, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert err["param"] == param, (kwargs, err)
            assert param is not None or "JSON" in err["message"], err
        events = [json.loads(line[6:]) for line in inflight.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == want
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": NAME, "prompt": "still fine", "max_tokens": 2}, timeout=T)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_penalties_and_logit_bias_equal_engine(srv, client, model):
    """OpenAI's frequency / presence penalties and logit_bias (string token-id keys), and
    vLLM's repetition_penalty, min_tokens and allowed_token_ids, reach the engine unchanged; requests without them beside
    them are untouched."""
    prompt, tok = "Say it again and again and again", model.tokenizer
    ids = tok.encode(prompt)
    bias_token = tok.encode(" again", add_special_tokens=False)[0]
    cases = [dict(frequency_penalty=1.5, presence_penalty=0.5), dict(extra_body={"repetition_penalty": 1.4}),
             dict(logit_bias={str(bias_token): 100}), dict(extra_body={"min_tokens": 8, "stop_token_ids": [bias_token]}),
             dict(extra_body={"allowed_token_ids": [bias_token, ids[0], ids[2]]})]
    for kwargs in cases:
        extra = kwargs.pop("extra_body", {})
        bias = {int(t): v for t, v in kwargs.pop("logit_bias", {}).items()}
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias, **kwargs, **extra)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True} | extra, **kwargs,
                                      **({"logit_bias": {str(t): v for t, v in bias.items()}} if bias else {}))
        assert r.choices[0].text == engine_text(model, ids, params)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(bias_token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([bias_token] * 4)


def test_structured_outputs_equal_engine(srv, client, model):
    """OpenAI's response_format and vLLM's structured_outputs / guided_* reach the engine as
    the same `StructuredOutputsParams`: the same text, and it follows the grammar."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Is it fine? Answer in JSON."}]
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    base = dict(temperature=0, max_tokens=12)
    r = client.chat.completions.create(model=NAME, messages=messages, **base, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}})
    want = engine_text(model, ids, SamplingParams(**base, structured_outputs={"json": schema}))
    assert r.choices[0].message.content == want
    prompt, ids = "The answer is", model.tokenizer.encode("The answer is")
    cases = [({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
             ({"structured_outputs": {"regex": "[0-9]{2}-[a-z]{2}"}}, {"regex": "[0-9]{2}-[a-z]{2}"}),
             ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
              {"json_object": True, "disable_any_whitespace": True}),
             # options alone in structured_outputs apply to another field's constraint (vLLM merges them)
             ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
              {"json_object": True, "disable_any_whitespace": True})]
    texts = []
    for extra, fields in cases:
        r = client.completions.create(model=NAME, prompt=prompt, **base, extra_body=extra)
        texts.append(r.choices[0].text)
        assert texts[-1] == engine_text(model, ids, SamplingParams(**base, structured_outputs=fields))
    assert texts[0] in ("yes", "no") and re.fullmatch("[0-9]{2}-[a-z]{2}", texts[1])
    alone = httpx.post(f"{srv.url}/v1/completions", json={"model": NAME, "prompt": prompt, "structured_outputs": {
        "disable_any_whitespace": True}}, timeout=T)  # an option without a constraint
    assert alone.status_code == 400 and "exactly one of json" in alone.json()["error"]["message"], alone.text


def test_keywords_the_grammar_cannot_enforce(srv, client):
    """OpenAI's non-strict schemas are best effort: `uniqueItems` (pydantic's `set`) is not
    enforced; strict ones refuse it by name, a tool's error naming that tool."""
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
            "required": ["tags"], "additionalProperties": False}
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Tags?"}], max_tokens=8, temperature=0)
    r = client.chat.completions.create(**kw, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": tags}})
    assert r.choices[0].message.content.startswith('{"tags"') or r.choices[0].message.content.lstrip().startswith("{")
    tagger = {"type": "function", "function": {"name": "tag", "parameters": tags}}
    r = client.chat.completions.create(**kw, tools=TOOLS + [tagger], tool_choice="required")
    assert r.choices[0].message.tool_calls
    for body, param in [({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": tags,
                                                                                     "strict": True}}}, "response_format"),
                        ({"tools": TOOLS + [{"type": "function", "function": tagger["function"] | {"strict": True}}],
                          "tool_choice": "required"}, "tools.2.function.parameters")]:
        err = httpx.post(f"{srv.url}/v1/chat/completions", json=kw | body, timeout=T)
        assert err.status_code == 400 and err.json()["error"]["param"] == param, err.text
        assert "uniqueItems" in err.json()["error"]["message"]


def test_auth(small):
    body = {"model": NAME, "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{small.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{small.url}/v1/models").status_code == 401
    assert httpx.post(f"{small.url}/tokenize", json={"prompt": "x"}).status_code == 401  # work for the server: keyed too
    assert httpx.get(f"{small.url}/health").status_code == httpx.head(f"{small.url}/health").status_code == 200
    assert httpx.get(f"{small.url}/metrics").status_code == 200
    # a browser's CORS preflight carries no key; it is answered, and so is the request after it
    preflight = httpx.options(f"{small.url}/v1/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")
    ok = openai.OpenAI(base_url=f"{small.url}/v1", api_key=KEY, max_retries=0, timeout=T)
    assert ok.completions.create(**body).usage.completion_tokens >= 1


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers=None) -> tuple[int, dict, int]:
    """(status, the last JSON event or the error body, text chunks) of one streaming request."""
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread()) | {"retry_after": r.headers.get("retry-after")}, 0
        last, chunks = None, 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                chunks += bool(last["choices"])
        return 200, last, chunks


def test_queue_full_is_429_and_spares_the_admitted(small):
    body = {"model": NAME, "prompt": "Busy", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def burst():
        async with httpx.AsyncClient(timeout=T) as c:
            jobs = [_stream(c, f"{small.url}/v1/completions", body, {"Authorization": f"Bearer {KEY}"}) for _ in range(ENGINE.max_slots + 4)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(burst())
    refused = [r for r in results if r[0] == 429]
    done = [r for r in results if r[0] == 200]
    assert refused and len(done) >= ENGINE.max_slots, [r[0] for r in results]
    assert all(r[1]["error"]["code"] == "queue_full" and r[1]["retry_after"] == "1" for r in refused)
    assert all(r[1]["usage"]["completion_tokens"] == 20 for r in done)  # the admitted run to the end
    small.wait_idle()
    assert small.metric("jaxinfer_kv_pages_used") == 0
    assert small.metric('jaxinfer_requests_rejected_total{reason="queue_full"}') == len(refused)



def test_a_pool_smaller_than_the_context_cuts_what_the_server_serves(model):
    """A pool of 2 pages of 16 holds 32 tokens of one request: the server reports and serves
    that context (a default max_tokens fits it; more is a context_length_exceeded)."""
    s = ServerThread(build_server(model, dataclasses.replace(ENGINE, num_pages=3), NAME, warmup=False))
    try:
        assert httpx.post(f"{s.url}/tokenize", json={"prompt": "Hi"}, timeout=T).json()["max_model_len"] == 32
        ok = httpx.post(f"{s.url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": None}, timeout=T)
        assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] <= 32, ok.text
        err = httpx.post(f"{s.url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 40}, timeout=T)
        assert err.status_code == 400 and err.json()["error"]["code"] == "context_length_exceeded", err.text
    finally:
        s.stop()


def test_more_choices_than_the_server_holds_are_a_400(model):
    """A 429 would be retried forever: no wait makes room for 5 choices on 2 slots + 2 queued."""
    s = ServerThread(build_server(model, dataclasses.replace(ENGINE, max_slots=2), NAME, max_queue=2, warmup=False))
    try:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 5}),
                           ("/v1/completions", {"prompt": "Hi", "n": 5}), ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2})):
            err = httpx.post(f"{s.url}{path}", json={"model": NAME, "max_tokens": 2} | body, timeout=T)
            assert err.status_code == 400 and "at most 4 requests" in err.json()["error"]["message"], err.text
        assert s.metric('jaxinfer_requests_rejected_total{reason="queue_full"}') == 0
    finally:
        s.stop()


def test_max_completion_tokens_wins_over_max_tokens(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8,
                                       max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_disconnect_aborts_and_frees_pages(srv):
    aborted = srv.metric('jaxinfer_requests_finished_total{finish_reason="abort"}')
    body = {"model": NAME, "prompt": "Leave early", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=T) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    # leaving the block closed the connection mid-stream
    srv.wait_idle()
    assert srv.metric('jaxinfer_requests_finished_total{finish_reason="abort"}') == aborted + 1
    assert srv.metric("jaxinfer_kv_pages_used") == 0


def test_load_200_concurrent_streams(srv):
    rng = random.Random(0)
    words = "alpha beta gamma delta stream token page cache".split()
    bodies = [{"model": NAME, "prompt": " ".join(rng.choices(words, k=rng.randint(1, 12))),
               "max_tokens": rng.randint(1, 8), "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}} for _ in range(200)]

    async def run():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=3 * T, limits=limits) as c:
            return await asyncio.gather(*[_stream(c, f"{srv.url}/v1/completions", b) for b in bodies])

    results = asyncio.run(run())
    assert [r[0] for r in results] == [200] * 200
    assert [r[1]["usage"]["completion_tokens"] for r in results] == [b["max_tokens"] for b in bodies]
    srv.wait_idle()
    assert srv.metric("jaxinfer_kv_pages_used") == 0
    assert srv.metric("jaxinfer_requests_waiting") == 0


def test_graceful_shutdown_finishes_in_flight(model):
    s = ServerThread(build_server(model, ENGINE, NAME, warmup=False))
    body = {"model": NAME, "prompt": "Last one", "max_tokens": 20, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=T) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        s.uvicorn.should_exit = True  # what SIGTERM does
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 20
    s.thread.join(T)
    assert not s.thread.is_alive() and not s.server.loop._thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{s.url}/health")


def test_requests_left_after_the_grace_period_are_stopped_with_a_503(model):
    """Shutdown with requests still running when the grace period ends: the engine loop stops
    them, a plain request gets a 503 `server_shutdown` and a stream ends with that error event
    (not a connection cut off by uvicorn's cancellation)."""
    s = ServerThread(build_server(model, ENGINE, NAME, warmup=False), grace_s=0.0)
    body = {"model": NAME, "prompt": "Long", "max_tokens": 60, "ignore_eos": True}
    plain = []
    sender = threading.Thread(target=lambda: plain.append(httpx.post(f"{s.url}/v1/completions", json=body, timeout=T)))
    sender.start()
    deadline = time.monotonic() + T
    while s.server.loop.outstanding < 1:  # the plain request is in the engine: 60 steps to go
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with httpx.stream("POST", f"{s.url}/v1/completions", json=body | {"stream": True}, timeout=T) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        s.uvicorn.should_exit = True  # what SIGTERM does
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    sender.join(T)
    assert events[-1]["error"]["code"] == "server_shutdown"
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_shutdown"
    s.thread.join(T)
    assert not s.thread.is_alive() and not s.server.loop._thread.is_alive()


def test_sigterm_drains_and_exits_with_status_zero(model):
    """`jaxinfer serve` as a process: SIGTERM mid-stream lets the stream finish, then exit 0."""
    import signal
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", "--model", model.source, "--port", str(port),
                             "--max-model-len", str(MAX_LEN), "--max-slots", "2", "--served-model-name", NAME],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + T
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": NAME, "prompt": "Bye", "max_tokens": 16, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=T) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 16
        assert proc.wait(T) == 0
    finally:
        proc.kill()
        proc.wait()


# ---- logprobs and speculative metrics ------------------------------------------------------------


def engine_output(model, ids, params):
    return Engine(model, ENGINE).generate([ids], params)[0]


def sse_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=T) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def legacy_token(tok, token_id: int) -> str:
    """OpenAI's legacy logprob token: its text, or "bytes:\\xNN.." for part of a character."""
    raw = tok.token_bytes(token_id)
    return raw.decode("utf-8") if _valid_utf8(raw) else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def text_offsets(tok, ids: list[int]) -> list[int]:
    """Characters of the decoded text before each token (complete characters only)."""
    raw = [tok.token_bytes(i) for i in ids]
    return [len(b"".join(raw[:j]).decode("utf-8", errors="ignore")) for j in range(len(ids))]


def test_completions_take_vllms_add_special_tokens(srv, model, monkeypatch):
    """vLLM's `add_special_tokens` (default true): false encodes a text prompt without BOS (for a
    prompt that holds it already); `use_beam_search` is refused, not ignored."""
    tok, encode = model.tokenizer, model.tokenizer.encode
    bos = tok.eos_ids[0]  # the tiny model's tokenizer adds nothing: play one that adds a BOS
    monkeypatch.setattr(tok, "encode", lambda text, add_special_tokens=True: [bos] * add_special_tokens + encode(text))
    body = {"model": NAME, "prompt": "Hi there", "max_tokens": 0, "echo": True, "logprobs": 0}
    with_bos = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=T).json()["usage"]["prompt_tokens"]
    without = httpx.post(f"{srv.url}/v1/completions", json=body | {"add_special_tokens": False}, timeout=T).json()
    assert with_bos == without["usage"]["prompt_tokens"] + 1 == len(tok.encode("Hi there"))
    err = httpx.post(f"{srv.url}/v1/completions", json=body | {"use_beam_search": True}, timeout=T)
    assert err.status_code == 400 and err.json()["error"]["param"] == "use_beam_search"


def test_legacy_logprobs_of_split_characters_stay_distinct(srv, model):
    """Pieces of different UTF-8 characters are distinct "bytes:" tokens and top_logprobs keys
    (as U+FFFD one would overwrite another), and offsets count the decoded text's characters."""
    text = "日本語のテキスト🙂 и ещё"
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": NAME, "prompt": text, "max_tokens": 0, "echo": True,
                                                        "logprobs": 5}, timeout=T).json()
    lp, ids = r["choices"][0]["logprobs"], model.tokenizer.encode(text, add_special_tokens=False)
    assert lp["tokens"] == [legacy_token(model.tokenizer, i) for i in ids] and any(t.startswith("bytes:") for t in lp["tokens"])
    assert lp["text_offset"] == text_offsets(model.tokenizer, ids) and lp["text_offset"][-1] < len(text)
    assert all(len(top) >= 5 for top in lp["top_logprobs"][1:])  # 5 distinct alternatives (+ the token)


def check_completion_logprobs(lp: dict, tok, want) -> None:
    """The legacy object equals the engine's per-token logprobs (`want`: a RequestOutput)."""
    texts = [legacy_token(tok, i) for i in want.token_ids]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == texts
    assert lp["text_offset"] == text_offsets(tok, want.token_ids)
    assert lp["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
    # the top alternatives in order, then the token itself where it is not among them (OpenAI's "logprobs + 1")
    tops = [{legacy_token(tok, i): v for i, v in alts} | {text: v} | {legacy_token(tok, i): v for i, v in alts}
            for text, v, alts in zip(texts, want.logprobs, want.top_logprobs)]
    assert [list(d) for d in lp["top_logprobs"]] == [list(d) for d in tops]
    assert [list(d.values()) for d in lp["top_logprobs"]] == [pytest.approx(list(d.values()), abs=1e-5) for d in tops]


def test_completion_logprobs_equal_engine(srv, model):
    tok = model.tokenizer
    want = engine_output(model, tok.encode("The quick brown fox"),
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))
    body = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 3}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=T).json()
    check_completion_logprobs(r["choices"][0]["logprobs"], tok, want)
    chunks = [e["choices"][0]["logprobs"] for e in sse_events(f"{srv.url}/v1/completions", body) if e["choices"]]
    merged = {key: [x for c in chunks for x in c[key]] for key in chunks[0]}
    assert all(c["tokens"] for c in chunks)  # each chunk carries its own tokens
    check_completion_logprobs(merged, tok, want)
    plain = httpx.post(f"{srv.url}/v1/completions", json=body | {"logprobs": None}, timeout=T).json()
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_equal_engine(srv, model):
    tok = model.tokenizer
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    want = engine_output(model, ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    body = {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=T).json()
    content = r["choices"][0]["logprobs"]["content"]

    def entry(token_id):
        return {"token": tok.token_text(token_id), "bytes": list(tok.token_bytes(token_id))}

    assert len(content) == len(want.token_ids)
    for got, token_id, logprob, alts in zip(content, want.token_ids, want.logprobs, want.top_logprobs):
        assert set(got) == {"token", "logprob", "bytes", "top_logprobs"}
        assert {k: got[k] for k in ("token", "bytes")} == entry(token_id)
        assert got["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert [{k: a[k] for k in ("token", "bytes")} for a in got["top_logprobs"]] == [entry(i) for i, _ in alts]
        assert [a["logprob"] for a in got["top_logprobs"]] == pytest.approx([v for _, v in alts], abs=1e-5)
    streamed = [e["choices"][0]["logprobs"] for e in sse_events(f"{srv.url}/v1/chat/completions", body)]
    assert [x for lp in streamed if lp for x in lp["content"]] == content
    off = httpx.post(f"{srv.url}/v1/chat/completions", json=body | {"logprobs": False, "top_logprobs": None}, timeout=T)
    assert off.json()["choices"][0]["logprobs"] is None


def test_token_bytes_of_a_split_utf8_character(model):
    """A byte-level piece may hold part of a character: its text shows U+FFFD, its bytes are raw."""
    tok = model.tokenizer
    ids = tok.encode("日本語のテキスト🙂", add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == "日本語のテキスト🙂"
    split = [p for p in pieces if not _valid_utf8(p)]
    assert split and all("\ufffd" in tok.token_text(i) for i, p in zip(ids, pieces) if p in split)


def _valid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_speculative_server_metrics_and_logprobs(srv, model):
    """/metrics exports the draft statistics of a speculating engine (and a plain one has none);
    logprobs through it equal the plain server's."""
    assert "jaxinfer_spec_" not in httpx.get(f"{srv.url}/metrics").text
    ids = np.arange(0, model.config.vocab_size, 2)  # the target's head over half the vocabulary: a greedy draft
    half = DraftModel(model.config, dataclasses.replace(model.params, lm_head=model.params.lm_head[ids]), vocab_ids=ids)
    draft = SpeculativeConfig("draft", 3, draft=half)  # is accepted iff the target's argmax has an even id
    s = ServerThread(build_server(model, dataclasses.replace(ENGINE, speculative=draft), NAME, warmup=False))
    try:
        for gauge in ("jaxinfer_spec_acceptance_rate", "jaxinfer_spec_tokens_per_call"):  # no value before a verify
            assert re.search(rf"^{gauge} NaN$", httpx.get(f"{s.url}/metrics").text, re.M), gauge
        body = {"model": NAME, "prompt": "one two three", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "logprobs": 2}
        spec = httpx.post(f"{s.url}/v1/completions", json=body, timeout=T).json()["choices"][0]["logprobs"]
        plain = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=T).json()["choices"][0]["logprobs"]
        assert spec["tokens"] == plain["tokens"]
        assert spec["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-5)
        s.wait_idle()
        stats = s.server.loop.snapshot.speculative
        assert 0 < stats.accepted.sum() < stats.drafted.sum()
        assert s.metric("jaxinfer_spec_draft_tokens_total") == stats.drafted.sum()
        assert s.metric("jaxinfer_spec_accepted_tokens_total") == stats.accepted.sum()
        assert s.metric("jaxinfer_spec_acceptance_rate") == pytest.approx(stats.acceptance_rate)
        assert s.metric("jaxinfer_spec_tokens_per_call") == pytest.approx(stats.tokens_per_call)
        text = httpx.get(f"{s.url}/metrics").text
        for i, a in enumerate(stats.acceptance_per_position):
            line = re.search(rf'^jaxinfer_spec_acceptance{{position="{i}"}} (\S+)$', text, re.M)
            assert line and (line.group(1) == "NaN" if a != a else float(line.group(1)) == pytest.approx(a))
    finally:
        s.stop()


def test_async_scheduling_server_equals_synchronous(model):
    """`serve --async-scheduling`: the same seeded texts (n = 2, stop strings, streamed) as the
    synchronous engine gives; a stream left mid-way still frees its pages."""
    prompt, sync = "Once upon a time", Engine(model, ENGINE)
    ids = model.tokenizer.encode(prompt)
    full = [sync.generate([ids], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True))[0].text
            for i in range(2)]
    stop = full[0].strip().split()[1]  # a word in the middle of the first choice
    s = ServerThread(build_server(model, dataclasses.replace(ENGINE, async_scheduling=True), NAME, warmup=False))
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=T)
        kw = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
        assert [c.text for c in client.completions.create(**kw).choices] == full
        streamed = ["", ""]
        for c in client.completions.create(stream=True, **(kw | {"stop": [stop]})):
            streamed[c.choices[0].index] += c.choices[0].text
        assert streamed == [t[: t.index(stop)] if stop in t else t for t in full]
        body = {"model": NAME, "prompt": "Leave early", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=T) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))
        s.wait_idle()
        assert s.metric("jaxinfer_kv_pages_used") == 0
    finally:
        s.stop()


def test_completion_echo_prepends_the_prompt(srv, client, model):
    prompt = "The quick brown fox"
    want = engine_text(model, model.tokenizer.encode(prompt), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    kw = dict(model=NAME, max_tokens=8, temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert client.completions.create(prompt=prompt, **kw).choices[0].text == prompt + want
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kw) if c.choices)
    assert streamed == prompt + want
    ids = model.tokenizer.encode(prompt)
    assert client.completions.create(prompt=ids, **kw).choices[0].text == model.tokenizer.decode(ids) + want


def test_completion_echo_with_logprobs_scores_the_prompt(srv, client, model):
    """echo + logprobs: the prompt's tokens come first with their teacher-forced logprobs (the
    first has none), then the generated ones; max_tokens 0 scores the prompt alone (how
    evaluation harnesses ask for a loglikelihood)."""
    prompt = "The quick brown fox jumps"
    ids = model.tokenizer.encode(prompt)
    logits = all_position_logits(model, np.asarray([ids], np.int32))[0]  # f32[n, V]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    want = [float(logp[i, t]) for i, t in enumerate(ids[1:])]
    kw = dict(model=NAME, prompt=prompt, temperature=0, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=4, **kw).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], want, atol=1e-4)
    assert all(len(top) == 2 + (text not in list(top)[:2]) and text in top for text, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset[len(ids)] == len(prompt) and full.text.startswith(prompt)
    only = client.completions.create(max_tokens=0, **kw)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]


def test_a_batch_of_prompts_is_checked_and_bounded_prompt_by_prompt(srv, model):
    """Each prompt of a batch gets the default max_tokens its own context leaves (16, or less
    near the end), in either order; token ids outside the vocabulary are a 400 also when the
    prompt would be echoed or scored; a prompt scored alone (max_tokens 0) may fill the context."""
    long, short = [7] * (MAX_LEN - 4), [7, 8, 9]
    for batch in ([short, long], [long, short]):
        choices = httpx.post(f"{srv.url}/v1/completions", timeout=T, json={
            "model": NAME, "prompt": batch, "temperature": 0, "ignore_eos": True, "logprobs": 0}).json()["choices"]
        assert [len(c["logprobs"]["tokens"]) for c in choices] == [16 if p is short else 4 for p in batch]
    for extra in ({"echo": True, "logprobs": 1, "max_tokens": 0}, {"prompt_logprobs": 1}, {}):
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": NAME, "prompt": [1, 10**6], **extra}, timeout=T)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "vocabulary" in r.json()["error"]["message"]
    full = {"model": NAME, "prompt": [7] * MAX_LEN, "echo": True, "logprobs": 1}
    scored = httpx.post(f"{srv.url}/v1/completions", json=full | {"max_tokens": 0}, timeout=T)
    assert scored.status_code == 200 and len(scored.json()["choices"][0]["logprobs"]["tokens"]) == MAX_LEN
    over = httpx.post(f"{srv.url}/v1/completions", json=full | {"max_tokens": 1}, timeout=T)
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        score_tokens(model, [1, 10**6])


def test_prompt_logprobs_as_vllm_returns_them(srv, model):
    """vLLM's `prompt_logprobs` extra: per prompt token (None for the first) a dict keyed by
    token id holding the token itself (logprob, rank, decoded_token) and its top alternatives;
    on completions per choice, on chat for the whole prompt; refused with stream: true."""
    prompt = "The quick brown fox jumps"
    ids = model.tokenizer.encode(prompt)
    logits = all_position_logits(model, np.asarray([ids], np.int32))[0]  # f32[n, V]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    body = {"model": NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 2}
    choices = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=T).json()["choices"]
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    got = choices[0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i, (token, entry) in enumerate(zip(ids[1:], got[1:])):
        row = logp[i]
        order = np.argsort(-row)
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token], abs=1e-4)
        assert mine["rank"] == 1 + int((row > row[token]).sum()) and mine["decoded_token"] == model.tokenizer.token_text(token)
        assert list(entry)[0] == str(token) and set(entry) == {str(token), *map(str, order[:2])}
        assert [entry[str(t)]["rank"] for t in order[:2]] == [1, 2]

    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    answer = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=T).json()
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in answer["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in httpx.post(f"{srv.url}/v1/completions", json=body | {"prompt_logprobs": None},
                                               timeout=T).json()["choices"][0]
    refused = httpx.post(f"{srv.url}/v1/completions", json=body | {"stream": True}, timeout=T)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_run_batch_answers_a_batch_file_as_the_server_would(model, client):
    """`run_batch` (`jaxinfer run-batch`, OpenAI's batch format): each line's answer, in input
    order, equal to the server's for the same request; requests of several choices beyond what
    the server holds wait instead of failing (429s retried); a refused request keeps its status
    and error body; lines that are not requests get an error naming the problem and their line."""
    from jaxinfer.server.batch import run_batch

    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "n": 2}
    text = {"model": NAME, "prompt": "Once upon", "max_tokens": 5, "temperature": 0}
    request = lambda i, url, body: json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})
    lines = ([request(i, "/v1/chat/completions", chat) for i in range(5)] + [request(5, "/v1/completions", text), ""]
             + [request(7, "/v1/responses", {"model": NAME, "input": "Hi", "max_output_tokens": 4, "temperature": 0}),
                request(8, "/v1/chat/completions", chat | {"model": "nope"}), request(9, "/v1/embeddings", {}),
                request(10, "/v1/completions", text | {"stream": True}), "{not json", '{"method": "POST"}'])
    server = build_server(model, dataclasses.replace(ENGINE, max_slots=2), NAME, max_queue=1, warmup=False)  # 3 places
    records = run_batch(server, lines)
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in (0, 1, 2, 3, 4, 5, 7, 8, 9, 10)] + [None, None]
    want_chat = client.chat.completions.create(**chat).choices[0].message.content
    for r in records[:5]:
        assert r["response"]["status_code"] == 200 and r["error"] is None and r["id"].startswith("batch_req_")
        assert [c["message"]["content"] for c in r["response"]["body"]["choices"]] == [want_chat] * 2
    assert records[5]["response"]["body"]["choices"][0]["text"] == client.completions.create(**text).choices[0].text
    assert records[6]["response"]["body"]["object"] == "response"
    assert records[7]["response"]["status_code"] == 404 and records[7]["response"]["body"]["error"]["param"] == "model"
    errors = [(r["error"]["line"], r["error"]["message"]) for r in records[8:]]
    assert [line for line, _ in errors] == [10, 11, 12, 13]
    for (_, message), named in zip(errors, ("url='/v1/embeddings'", "body.stream", "not JSON", "custom_id")):
        assert named in message, message
    assert all(r["response"] is None for r in records[8:])
