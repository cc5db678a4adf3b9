"""Serving reliability (issue 15): one bad request never hurts another, every error reaches
the client in the OpenAI shape, no input causes a 5xx, and a client that leaves has its
request aborted with or without an API key.

Same tiny model and engine shapes as test_server.py, with a small page pool (so the soak
test preempts). Bodies are sent as JSON text written here: `json.dumps` spells NaN and
Infinity (which the server's parser accepts) and escapes lone surrogates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import logging
import random
import socket
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.checkpoint import save_orbax
from jaxinfer.engine import Engine
from jaxinfer.loading import load_model
from jaxinfer.sampling import SamplingParams
from jaxinfer.server import build_server
from jaxinfer.tokenizer import Tokenizer
from test_server import ENGINE, KEY, MAX_LEN, NAME, T, ServerThread
from tiny_models import tiny_model

POOL = dataclasses.replace(ENGINE, num_pages=24)  # 23 usable pages for 16 slots of up to 4: preemption
GREEDY_TOKENS = 24
WORDS = "alpha beta gamma delta stream token page cache".split()


@pytest.fixture(scope="module")
def model(smollm2_gguf, tmp_path_factory):
    tok = Tokenizer.from_gguf(smollm2_gguf)
    config, params = tiny_model(vocab_size=tok.vocab_size, eos_ids=tok.eos_ids, max_position=MAX_LEN)
    return load_model(save_orbax(config, params, tmp_path_factory.mktemp("tiny") / "model", tokenizer=tok))


@pytest.fixture(scope="module")
def srv(model):
    s = ServerThread(build_server(model, POOL, NAME, warmup=False))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(model):
    s = ServerThread(build_server(model, POOL, NAME, api_key=KEY, warmup=False))
    yield s
    s.stop()


# ---- helpers ------------------------------------------------------------------------------------

def completion(prompt: str, max_tokens: int = GREEDY_TOKENS, **extra) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra


def chat(content, max_tokens: int = GREEDY_TOKENS, **extra) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True} | extra


def encode(body: dict) -> bytes:
    return json.dumps(body).encode()  # allow_nan and ensure_ascii: NaN, Infinity and "\ud800" as sent by clients


HEADERS = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, content=encode(body), headers=HEADERS, timeout=T)


def expected_text(model, body: dict) -> str:
    """What the engine alone generates for a greedy completion or chat body."""
    tok = model.tokenizer
    if "prompt" in body:
        ids = tok.encode(body["prompt"])
    else:
        ids = tok.encode(tok.apply_chat_template(body["messages"]), add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=body["max_tokens"], ignore_eos=True)
    return Engine(model, POOL).generate([ids], params)[0].text


def path_of(body: dict) -> str:
    return "/v1/completions" if "prompt" in body else "/v1/chat/completions"


def sse_text(events: list[dict]) -> str:
    choice = [e["choices"][0] for e in events if e.get("choices")]
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choice)


def check_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


class Neighbour:
    """A greedy stream that is mid-generation while something else happens; `finish()`
    reads it to the end and checks it produced exactly its normal output."""

    def __init__(self, url: str, body: dict, want: str):
        self.want = want
        self.response_cm = httpx.stream("POST", url + path_of(body), content=encode(body | {"stream": True}),
                                        headers=HEADERS, timeout=T)
        r = self.response_cm.__enter__()
        assert r.status_code == 200
        self.lines = r.iter_lines()
        self.events = [self._next_event()]  # the first token is out: the request holds its slot

    def _next_event(self) -> dict:
        return json.loads(next(line for line in self.lines if line.startswith("data: {"))[6:])

    def finish(self) -> None:
        self.events += [json.loads(line[6:]) for line in self.lines if line.startswith("data: {")]
        self.response_cm.__exit__(None, None, None)
        assert sse_text(self.events) == self.want
        assert self.events[-1]["choices"][-1]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def neighbour_body(model):
    body = completion("A neighbour that must not notice", max_tokens=50)
    return body, expected_text(model, body)


# ---- 1. fault isolation -------------------------------------------------------------------------

NUMERIC_FIELDS = {
    "/v1/completions": ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs",
                        "stop_token_ids", "frequency_penalty", "presence_penalty"],
    "/v1/chat/completions": ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                             "n", "top_logprobs", "stop_token_ids", "frequency_penalty", "presence_penalty"],
}
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 17, 63, 64, 2**31 - 1, 2**31, 2**32, 2**63, -(2**63) - 1, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-320, 1e-6, 0.5, 1.0 + 1e-9, 3.4e38]),
    st.sampled_from([None, True, "7", [], {}]),
)


def fuzzed_body(path: str, field: str, value) -> dict:
    body = completion("fuzz", max_tokens=8) if path == "/v1/completions" else chat("fuzz", max_tokens=8)
    if field == "stop_token_ids":
        value = [value]
    if field == "top_logprobs":
        body["logprobs"] = True
    return body | {field: value}


FIELDS = [(path, field) for path, fields in NUMERIC_FIELDS.items() for field in fields]


def test_fuzzed_numeric_fields_get_a_400_or_an_answer_and_never_disturb_running_requests(srv, neighbour_body):
    """Each example sends one request per numeric field of both endpoints, each with a drawn
    value, all at once while a greedy neighbour is mid-generation; the neighbour's output
    must be its normal one and no fuzzed request may get a 5xx or a 200 without choices."""
    body, want = neighbour_body
    errors = srv.metric('jaxinfer_requests_finished_total{finish_reason="error"}')

    async def fuzz(values: list, streams: list[bool]) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=T, limits=httpx.Limits(max_connections=64)) as c:
            jobs = [c.post(srv.url + path, content=encode(fuzzed_body(path, field, value) | {"stream": stream}),
                           headers=HEADERS) for (path, field), value, stream in zip(FIELDS, values, streams)]
            return await asyncio.gather(*jobs)

    @settings(max_examples=25, deadline=None)
    @given(values=st.lists(NUMBERS, min_size=len(FIELDS), max_size=len(FIELDS)),
           streams=st.lists(st.booleans(), min_size=len(FIELDS), max_size=len(FIELDS)))
    def one_round(values, streams):
        neighbour = Neighbour(srv.url, body, want)
        for (path, field), value, stream, r in zip(FIELDS, values, streams, asyncio.run(fuzz(values, streams))):
            if r.status_code == 400:
                param = check_openai_error(r, 400)["param"] or ""
                assert param.split(".")[0] in (field, "max_tokens"), (field, value, r.text)
            else:
                assert r.status_code == 200, (field, value, r.text)
                check_answer(r, stream, n=int(value) if field == "n" else 1)
        neighbour.finish()

    one_round()
    srv.wait_idle()
    assert srv.metric("jaxinfer_kv_pages_used") == 0
    assert srv.metric('jaxinfer_requests_finished_total{finish_reason="error"}') == errors  # no request failed in the engine


def check_answer(r: httpx.Response, stream: bool, n: int) -> None:
    """A 200 always carries every choice with a finish_reason."""
    if not stream:
        choices = r.json()["choices"]
    else:
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert all("error" not in e for e in events), events[-1]
        choices = [c for e in events for c in e["choices"] if c.get("finish_reason")]
    assert sorted(c["index"] for c in choices) == list(range(n))
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_fails_inside_the_engine_gets_an_error_and_the_others_their_output(
        srv, model, neighbour_body, monkeypatch, caplog, stream):
    """A parameter that slips past validation (planted: altered after it) overflows the
    step's arrays: only its request fails, with an error it sees; the neighbours finish."""
    real_params = srv.server.params

    def params_with_a_hole(body, ids, default_max_tokens):
        params = real_params(body, ids, default_max_tokens)
        if body.user == "saboteur":
            for p in params:
                object.__setattr__(p, "top_k", 2**40)
        return params

    monkeypatch.setattr(srv.server, "params", params_with_a_hole)
    body, want = neighbour_body
    neighbours = [Neighbour(srv.url, body, want) for _ in range(3)]
    bad = completion("sabotage", user="saboteur", n=2, stream=stream)
    with caplog.at_level(logging.ERROR):
        r = post(srv.url + "/v1/completions", bad)
    if stream:
        assert r.status_code == 200  # the stream had started: the error is an SSE event, then [DONE]
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert not any(c.get("finish_reason") for line in lines[:-2] for c in json.loads(line[6:])["choices"])
    else:
        error = check_openai_error(r, 500)
    assert error["type"] == "server_error" and error["code"] == "engine_error" and "top_k" in error["message"]
    for n in neighbours:
        n.finish()
    assert "top_k" in caplog.text and "srv-" in caplog.text  # logged with the engine request id
    srv.wait_idle()
    assert srv.metric("jaxinfer_kv_pages_used") == 0


# ---- 2. no 5xx from input -----------------------------------------------------------------------

ODD_TEXT = "\x00\ufffe\U0010ffff\u202e\u0301\ufeff日本語🙂"
UNICODE_CASES = [  # (body, status, param)
    (completion("lone \ud800 surrogate"), 400, "prompt"),
    (completion(["a\udc80b"]), 400, "prompt"),
    (chat("high \ud83d alone"), 400, "messages"),
    (chat([{"type": "text", "text": "\udfff"}]), 400, "messages"),
    (chat([{"type": "text", "text": 5}]), 400, "messages.0.content"),
    (completion("x") | {"model": "\ud800"}, 404, "model"),
    (completion(ODD_TEXT, max_tokens=2), 200, None),
    (chat(ODD_TEXT, max_tokens=2), 200, None),
    (completion("salted", max_tokens=2, user="\ud800", stop=["\udc00"]), 200, None),
    (completion("🙂" * 200), 400, "prompt"),
]


def test_text_input_never_causes_a_5xx_and_the_connection_stays_open(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=T)
    conn.connect()
    first_socket = conn.sock
    for body, status, param in UNICODE_CASES:
        conn.request("POST", path_of(body), body=encode(body), headers={"content-type": "application/json"})
        r = conn.getresponse()
        data = json.loads(r.read())
        assert r.status == status, (body, data)
        if status in (400, 404):
            assert data["error"]["type"] == "invalid_request_error" and data["error"]["param"].startswith(param), data
        assert not r.will_close and conn.sock is first_socket  # the same connection serves the next one
    conn.close()


def test_an_unexpected_error_is_an_openai_500_naming_the_logged_request_id(srv, monkeypatch, caplog):
    def broken(body):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(srv.server, "completion_prompts", broken)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=T)
    with caplog.at_level(logging.ERROR, logger="jaxinfer.server.app"):
        conn.request("POST", "/v1/completions", body=encode(completion("x")), headers={"content-type": "application/json"})
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
    request_id = r.getheader("x-request-id")
    assert r.status == 500 and err["type"] == "server_error" and err["code"] == "internal_error"
    assert request_id and request_id in err["message"] and "planted" not in err["message"]
    assert request_id in caplog.text and "planted bug" in caplog.text
    assert not r.will_close
    monkeypatch.undo()
    conn.request("POST", "/v1/completions", body=encode(completion("x", max_tokens=2)),
                 headers={"content-type": "application/json"})
    assert conn.getresponse().status == 200  # on the same connection
    conn.close()


# ---- 3. disconnects abort -----------------------------------------------------------------------


@pytest.mark.parametrize("with_key, stream, flowing", [(False, False, False), (True, False, False), (False, True, False),
                                                      (True, True, False), (False, False, True), (False, True, True)])
def test_a_client_that_disconnects_has_its_request_aborted(srv, keyed, monkeypatch, with_key, stream, flowing):
    """The engine is held mid-request (its step waits) until the server calls abort for the
    request, which it does only if it saw the client go; then everything is freed. `flowing`:
    the steps go on (slowly), so the request's tokens keep coming while nobody reads them."""
    s = keyed if with_key else srv
    s.wait_idle()
    loop = s.server.loop
    in_step, release, abort_called = threading.Event(), threading.Event(), threading.Event()
    real_step, real_abort = loop.engine.step, loop.abort

    steps = iter(range(1 << 30))

    def held_step():
        if not flowing:
            in_step.set()
            release.wait(T)
        elif next(steps) >= 5:  # the client leaves once tokens flow (a step every ~0.1 s, none slow)
            in_step.set()
            time.sleep(0.1)  # 60 tokens take > 6 s: the request must be aborted long before it ends
        return real_step()

    def abort(ids):
        abort_called.set()
        real_abort(ids)

    monkeypatch.setattr(loop.engine, "step", held_step)
    monkeypatch.setattr(loop, "abort", abort)
    aborted = s.metric('jaxinfer_requests_finished_total{finish_reason="abort"}')
    body = encode(completion("Leave early", max_tokens=60, stream=stream))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nAuthorization: Bearer {KEY}\r\n\r\n")
    client = socket.create_connection(("127.0.0.1", s.port))
    try:
        client.sendall(head.encode() + body)
        assert in_step.wait(T), "the request never reached the engine"
    finally:
        client.close()  # the client leaves mid-generation
    try:
        assert abort_called.wait(30), "the server did not notice the client leave"
    finally:
        release.set()
    s.wait_idle()
    assert s.metric('jaxinfer_requests_finished_total{finish_reason="abort"}') == aborted + 1
    assert s.metric("jaxinfer_kv_pages_used") == 0


# ---- 5. soak ------------------------------------------------------------------------------------


def soak_requests(rng: random.Random) -> list[tuple[str, dict]]:
    """(kind, body): valid greedy (checked against the engine), invalid, aborted streams,
    disconnected non-streaming requests, oversized prompts or max_tokens."""
    valid = [completion(" ".join(rng.choices(WORDS, k=rng.randint(1, 10))), max_tokens=rng.randint(1, 16))
             for _ in range(6)]
    valid += [chat(" ".join(rng.choices(WORDS, k=rng.randint(1, 6))), max_tokens=rng.randint(1, 12)) for _ in range(4)]
    invalid = [completion("x", top_k=2**40), completion("x", temperature=float("nan")), chat("x", n=99),
               completion("x", seed=2**70), chat("x", top_p=0), completion("x", stop=[""]), completion("x", logprobs=21),
               chat("\ud800"), {"model": NAME}, completion("x", presence_penalty=3.0)]
    oversized = [completion("word " * MAX_LEN), completion("x", max_tokens=MAX_LEN), chat("🙂" * 500)]
    plan = []
    for _ in range(300):
        kind = rng.choices(["valid", "invalid", "aborted", "disconnected", "oversized"], [5, 2, 1, 1, 1])[0]
        if kind == "valid":
            plan.append((kind, rng.choice(valid) | {"stream": rng.random() < 0.5}))
        elif kind == "invalid":
            plan.append((kind, rng.choice(invalid)))
        elif kind == "oversized":
            plan.append((kind, rng.choice(oversized)))
        else:
            plan.append((kind, rng.choice(valid) | {"max_tokens": 40, "stream": kind == "aborted"}))
    return plan


async def soak_one(c: httpx.AsyncClient, url: str, kind: str, body: dict) -> tuple[int, str | None]:
    """(status, generated text: None when the client left or the request was refused)."""
    request = c.build_request("POST", url + path_of(body), content=encode(body), headers=HEADERS)
    if kind == "disconnected":
        try:
            r = await asyncio.wait_for(c.send(request), 0.2)  # gives up: the connection is dropped
            return r.status_code, None
        except asyncio.TimeoutError:
            return 0, None
    r = await c.send(request, stream=True)
    try:
        if r.status_code != 200 or not body.get("stream"):
            data = json.loads(await r.aread())
            if r.status_code != 200:
                return r.status_code, None
            choice = data["choices"][0]
            return 200, choice.get("text", choice.get("message", {}).get("content"))
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if kind == "aborted" and len(events) == 2:
                    return 200, None  # leaves mid-stream
        assert "error" not in events[-1], events[-1]
        return 200, sse_text(events)
    finally:
        await r.aclose()


def test_soak_mixed_traffic_leaves_nothing_behind(srv, model):
    plan = soak_requests(random.Random(0))
    errors = srv.metric('jaxinfer_requests_finished_total{finish_reason="error"}')
    wanted = {json.dumps(body, sort_keys=True): None for kind, body in plan if kind == "valid"}
    for key in wanted:
        wanted[key] = expected_text(model, json.loads(key))

    async def run():
        limits = httpx.Limits(max_connections=48)
        async with httpx.AsyncClient(timeout=T, limits=limits) as c:
            return await asyncio.gather(*[soak_one(c, srv.url, kind, body) for kind, body in plan])

    results = asyncio.run(run())
    statuses = [status for status, _ in results]
    assert all(s < 500 for s in statuses), sorted(set(statuses))
    for (kind, body), (status, text) in zip(plan, results):
        if kind == "valid":
            assert status == 200 and text == wanted[json.dumps(body, sort_keys=True)], body
        elif kind in ("invalid", "oversized"):
            assert status == 400, body
    srv.wait_idle()
    assert srv.metric("jaxinfer_kv_pages_used") == 0
    assert srv.metric("jaxinfer_kv_pages_free") == POOL.num_pages - 1  # free or cached and evictable
    assert srv.metric('jaxinfer_requests_finished_total{finish_reason="error"}') == errors
    assert srv.server.loop._thread.is_alive() and srv.thread.is_alive()  # the same server, still serving
    assert post(srv.url + "/v1/completions", completion("after", max_tokens=2)).status_code == 200
