"""Reasoning models' thinking, split from their answer, as vLLM's `--reasoning-parser` does.

Qwen3 and DeepSeek-R1 write their chain of thought between `<think>` and `</think>` before the
answer. With `jaxinfer serve --reasoning-parser qwen3` (or `deepseek_r1`) a chat answer's
message carries that text as `reasoning_content` (and `reasoning`, vLLM's newer name) and the
rest as `content`; streamed, each delta carries the part of its text on each side. The two
parsers differ where the tags are missing:

- `qwen3`: the model opens `<think>` itself; an answer that does not begin with it is all
  content (thinking switched off: `chat_template_kwargs: {"enable_thinking": false}`).
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the answer starts inside
  the thinking (a `<think>` the model writes anyway is dropped).

Both: a thinking never closed (cut short by `max_tokens`) is all reasoning, streamed or not.

A request's `include_reasoning: false` drops the reasoning.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.server.tools import partial_suffix

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """One model family's convention (module docstring)."""

    name: str
    starts_inside: bool  # the prompt opened the thinking (DeepSeek-R1)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer -> (reasoning, content); None where there is none."""
        if not (text.startswith(START) or self.starts_inside):
            return None, text or None
        reasoning, _, content = text.removeprefix(START).partition(END)  # unclosed: thinking cut short
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Splits a streamed answer's deltas as `ReasoningParser.split` splits the whole, holding
    back text that may still turn out to be a tag."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self._state = "lead"  # lead (a <think> may open the answer) | reasoning | content
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The next delta -> (reasoning, content) it releases."""
        text, self._held = self._held + text, ""
        if self._state == "lead":
            if text == START:
                self._state = "reasoning"
                return "", ""
            if START.startswith(text):  # "", "<th": not decided yet
                self._held = text
                return "", ""
            opened = text.startswith(START)
            text = text.removeprefix(START)
            self._state = "reasoning" if opened or self.parser.starts_inside else "content"
        if self._state == "content":
            return "", text
        reasoning, closed, content = text.partition(END)
        if closed:
            self._state = "content"
            return reasoning, content
        keep = partial_suffix(text, END)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is held back, at the end of the answer."""
        held, self._held = self._held, ""
        if self._state == "lead":
            return (held, "") if self.parser.starts_inside else ("", held)
        return (held, "") if self._state == "reasoning" else ("", held)


REASONING_PARSERS = {"qwen3": ReasoningParser("qwen3", starts_inside=False),
                     "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True)}


def find_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser named `name` (None: none); a ValueError names the choices."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r}: the parsers are {', '.join(REASONING_PARSERS)}")
    return None if name is None else REASONING_PARSERS[name]
