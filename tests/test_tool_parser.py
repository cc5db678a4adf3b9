"""Tool calls in an answer's text (`HermesCalls`: `<tool_call>{json}</tool_call>`;
`Llama3JsonCalls`: the answer is `{json}` calls), parsed whole and as the text streams in
pieces (the same content and calls either way); the calls of a "required" answer as it
streams (`RequiredCalls`)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.server.tools import HermesCalls, Llama3JsonCalls, RequiredCalls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
PING = '<tool_call>{"name": "ping", "parameters": {}}</tool_call>'


def named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_finds_calls_and_keeps_the_rest_as_content():
    content, calls = HermesCalls.parse("Let me look.\n" + WEATHER + "\n" + PING)
    assert content == "Let me look."
    assert named(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("ping", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") and "index" not in c for c in calls)
    assert len({c["id"] for c in calls}) == 2

    assert HermesCalls.parse(WEATHER)[0] is None  # nothing but calls: no content
    assert HermesCalls.parse("no calls here ") == ("no calls here ", [])  # untouched
    # not a call (no JSON, no name): the text as written, nothing lost
    for text in ("a <tool_call>not json</tool_call> b", 'x <tool_call>{"arguments": {}}</tool_call>', "<tool_call> open"):
        assert HermesCalls.parse(text) == (text, [])
    # a last block left open (the answer stopped at EOS right after the JSON) is still a call
    content, calls = HermesCalls.parse('Sure. <tool_call>{"name": "ping", "arguments": "{}"}')
    assert content == "Sure." and named(calls) == [("ping", {})]


def test_streaming_holds_back_only_what_may_start_a_call():
    parser = HermesCalls()
    assert parser.feed("Hello <tool") == ("Hello ", [])  # "<tool" may begin "<tool_call>"
    assert parser.feed("s are fun") == ("<tools are fun", [])
    assert parser.feed(" <tool_call>{\"name\": \"ping\", ") == (" ", [])
    content, calls = parser.feed('"arguments": {}}</tool_call> done')
    assert content == " done" and named(calls) == [("ping", {})] and calls[0]["index"] == 0
    assert parser.finish() == ("", []) and parser.calls == 1


def test_llama3_json_calls_are_the_whole_answer():
    weather = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    content, calls = Llama3JsonCalls.parse("<|python_tag|>" + weather + "; " + '{"name": "ping", "arguments": {}}')
    assert content is None and named(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("ping", {})]
    assert named(Llama3JsonCalls.parse("\n " + weather)[1]) == [("get_weather", {"city": "Paris", "days": 2})]
    # text, or anything that is not wholly calls: content as written
    for text in ("The weather is fine.", '{"city": "Paris"}', weather + " and then some", "{not json", "<|python_tag|>",
                 '[{"name": "x"}]', " <|python"):
        assert Llama3JsonCalls.parse(text) == (text, []), text
    parser = Llama3JsonCalls()
    assert parser.feed(" ") == ("", []) and parser.feed("Sun") == (" Sun", []) and parser.feed("ny {") == ("ny {", [])
    parser = Llama3JsonCalls()
    assert parser.feed("<|py") == ("", []) and parser.feed("thon_tag|>" + weather) == ("", [])
    assert named(parser.finish()[1]) == [("get_weather", {"city": "Paris", "days": 2})]


HERMES_PARTS = ["Hi ", WEATHER, PING, "<tool_call>bad</tool_call>", "<", "_call>", " x", "\n"]
LLAMA_PARTS = ['{"name": "a", "parameters": {"k": [1, ";"]}}', "; ", "<|python_tag|>", " ", "Hi", "{", "}"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([(HermesCalls, HERMES_PARTS), (Llama3JsonCalls, LLAMA_PARTS)]).flatmap(
    lambda p: st.tuples(st.just(p[0]), st.lists(st.sampled_from(p[1]), max_size=6))), st.lists(st.integers(0, 400), max_size=8))
def test_streamed_in_any_pieces_equals_parsed_whole(parser_parts, cuts):
    parser_class, parts = parser_parts
    text = "".join(parts)
    cuts = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])] or [""]
    parser, content, calls = parser_class(), "", []
    for i, piece in enumerate(pieces):  # as the server streams: trailing whitespace held back
        more, new = parser.stream(piece, finished=i == len(pieces) - 1)
        content, calls = content + more, calls + new
    whole_content, whole_calls = parser_class.parse(text)
    assert named(calls) == named(whole_calls) and [c["index"] for c in calls] == list(range(len(calls)))
    # only leading whitespace, sent before any call was seen, differs from the whole answer's
    assert (content.lstrip() if whole_calls else content) == (whole_content or "")


CALLS = [{"name": "set_unit", "parameters": {"unit": "c", "note": 'she wrote "}" and "[", \\ é'}},
         {"parameters": {}, "name": "ping"}, {"name": "nest", "parameters": {"a": [1, {"b": None}], "c": 2.5}}]


def reassembled(deltas):
    """Calls rebuilt from streamed deltas as OpenAI clients do: by index, arguments appended."""
    calls = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        call["id"] = d.get("id") or call["id"]
        call["name"] = d.get("function", {}).get("name") or call["name"]
        call["arguments"] += d["function"].get("arguments") or ""
    return calls


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(CALLS), min_size=1, max_size=3), st.lists(st.integers(0, 300), max_size=10))
def test_required_calls_streamed_in_any_pieces_equal_the_whole_answer(calls, cuts):
    """A "required" answer (compact JSON, `constraint`) streamed in any pieces: each call's
    header once, before its arguments; the arguments reassemble to the value as written."""
    text = json.dumps(calls, separators=(",", ":"), ensure_ascii=False)
    whole = RequiredCalls.parse(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == [
        (c["name"], c["parameters"]) for c in calls]
    reader, deltas = RequiredCalls(), []
    cuts = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(cuts, cuts[1:]):
        deltas += reader.feed(text[a:b])
    assert reader.closed
    headers = [d for d in deltas if "id" in d]
    assert [d["index"] for d in headers] == list(range(len(calls)))  # one header per call, in order
    for h in headers:  # a call's header comes before any of its arguments
        first = next(i for i, d in enumerate(deltas) if d["index"] == h["index"])
        assert deltas[first] is h
    assert [(c["name"], c["arguments"]) for c in reassembled(deltas).values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(CALLS), min_size=1, max_size=3), st.data())
def test_required_calls_cut_short_parse_as_they_stream(calls, data):
    """An answer cut short (max_tokens) parses to what its stream gave: the calls named so
    far, their arguments as far as written, a prefix of the whole answer's."""
    text = json.dumps(calls, separators=(",", ":"), ensure_ascii=False)
    end = data.draw(st.integers(0, len(text) - 1))
    reader = RequiredCalls()
    streamed = reassembled(reader.feed(text[:end]))
    cut = RequiredCalls.parse(text[:end])
    assert not reader.closed
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in cut] == [
        (c["name"], c["arguments"]) for c in streamed.values()]
    whole = RequiredCalls.parse(text)
    assert all(c["function"]["name"] == w["function"]["name"] and w["function"]["arguments"].startswith(
        c["function"]["arguments"]) for c, w in zip(cut, whole)) and len(cut) <= len(whole)


def test_strict_functions_and_formats_close_their_objects():
    """`"strict": true` on a function (named or "required" calls) or on a response format's
    json_schema closes the schema's objects (`strict_schema`); without it the schema is used
    as sent."""
    from jaxinfer.server.protocol import ChatCompletionRequest
    from jaxinfer.server.tools import constraint

    unit = {"type": "object", "properties": {"unit": {"type": "string"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for strict in (True, False, None):
        tools = [{"type": "function", "function": {"name": "f", "parameters": unit, "strict": strict}}]
        req = ChatCompletionRequest.model_validate(body | {"tools": tools, "tool_choice": {"type": "function",
                                                                                            "function": {"name": "f"}}})
        named = constraint(req.tools, req.tool_choice, None)["json"]
        required = constraint(req.tools, "required", None)["json"]["items"]["anyOf"][0]["properties"]["parameters"]
        assert named.get("additionalProperties") == required.get("additionalProperties") == (False if strict else None)
        fmt = {"type": "json_schema", "json_schema": {"name": "u", "schema": unit, "strict": strict}}
        [params] = ChatCompletionRequest.model_validate(body | {"response_format": fmt}).sampling_params(8)
        assert json.loads(params.structured_outputs.json).get("additionalProperties") == (False if strict else None)
