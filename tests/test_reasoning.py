"""The reasoning parsers (`jaxinfer.reasoning`): a whole answer's split, and the same
split from any way of cutting it into streamed deltas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.reasoning import END, REASONING_PARSERS, START, find_reasoning_parser

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize("parser, text, want", [
    (QWEN3, "<think>a\nb</think>\n\nAnswer", ("a\nb", "\n\nAnswer")),
    (QWEN3, "Answer without thinking", (None, "Answer without thinking")),
    (QWEN3, "<think>cut short", ("cut short", None)),  # a thinking cut short by max_tokens
    (QWEN3, "x<think>y</think>z", (None, "x<think>y</think>z")),  # only a leading <think> opens it
    (QWEN3, "<think></think>only", (None, "only")),
    (R1, "thinking</think>Answer", ("thinking", "Answer")),  # the prompt opened <think>
    (R1, "<think>thinking</think>Answer", ("thinking", "Answer")),  # one written anyway is dropped
    (R1, "cut short", ("cut short", None)),
    (R1, "", (None, None)),
])
def test_split(parser, text, want):
    assert parser.split(text) == want


pieces = st.lists(st.sampled_from(["<", "<th", "ink>", START, END, "</", "think", ">", "a", "b\n", " "]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=pieces, cuts=st.lists(st.integers(0, 60), max_size=6), parser=st.sampled_from([QWEN3, R1]))
def test_streamed_deltas_split_as_the_whole_answer(pieces, cuts, parser):
    """Fed in any pieces, the stream releases what `split` gives the whole text."""
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream, reasoning, content = parser.stream(), "", ""
    for a, b in zip(bounds, bounds[1:]):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    reasoning, content = reasoning + r, content + c
    want = parser.split(text)
    assert (reasoning or None, content or None) == want


def test_unknown_parser_is_named():
    assert find_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="reasoning_parser='granite': the parsers are qwen3, deepseek_r1"):
        find_reasoning_parser("granite")


def test_earlier_thinking_reaches_the_chat_template():
    """An assistant message's `reasoning_content` (or vLLM's `reasoning`), and a Responses
    `reasoning` item sent back in `input`, become the next assistant turn's `reasoning_content`
    (what templates that keep the latest thinking read)."""
    from jaxinfer.server.protocol import ChatMessage
    from jaxinfer.server.responses import ResponsesRequest

    for name in ("reasoning_content", "reasoning"):
        assert ChatMessage(role="assistant", content="4", **{name: "2+2"}).template_fields()["reasoning_content"] == "2+2"
    assert "reasoning_content" not in ChatMessage(role="assistant", content="4").template_fields()
    thought = {"type": "reasoning", "id": "rs-1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    chat = ResponsesRequest(input=[{"role": "user", "content": "q"}, thought, call, dict(call, call_id="c2"),
                                   {"type": "function_call_output", "call_id": "c1", "output": "x"},
                                   {**thought, "content": [], "summary": [{"type": "summary_text", "text": "so"}]},
                                   {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]).to_chat()
    turns = [m.template_fields() for m in chat.messages]
    assert [(t["role"], t.get("reasoning_content"), len(t.get("tool_calls", []))) for t in turns] == [
        ("user", None, 0), ("assistant", "hm", 2), ("tool", None, 0), ("assistant", "so", 0), ("user", None, 0)]
