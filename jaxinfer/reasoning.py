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

Structured output (`EngineConfig.reasoning_parser`, set by `serve --reasoning-parser`) follows
the same reading, as vLLM's does: the thinking is free text and the grammar constrains the answer
after `</think>` (`jaxinfer.structured_output.AfterThinking`). A prompt that ends with a closed
thinking (Qwen3's template with thinking switched off) starts the answer at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.tokenizer import Tokenizer

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """One model family's convention (module docstring)."""

    name: str
    starts_inside: bool  # the prompt opened the thinking (DeepSeek-R1)
    start: str = START
    end: str = END

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer -> (reasoning, content); None where there is none."""
        if not (text.startswith(self.start) or self.starts_inside):
            return None, text or None
        reasoning, _, content = text.removeprefix(self.start).partition(self.end)  # unclosed: thinking cut short
        return reasoning or None, content or None

    def opening(self, prompt_end: str) -> str:
        """Where an answer to a prompt ending with `prompt_end` starts: "answer" (the prompt
        closed a thinking), "thinking" (the template opened it) or "lead" (the model may
        open one with its first token)."""
        if prompt_end.rstrip().endswith(self.end):
            return "answer"
        return "thinking" if self.starts_inside else "lead"

    def tag_ids(self, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
        """The token ids of the opening and closing tags."""
        return tuple(tokenizer.encode(tag, add_special_tokens=False) for tag in (self.start, self.end))

    def count(self, token_ids: Sequence[int], tokenizer: Tokenizer) -> int:
        """Tokens of the thinking in an answer, its tags included (the answer's
        `reasoning_tokens`): read from the text as `split` reads it, whatever tokens spell the
        tags."""
        ids = list(token_ids)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if not (text.startswith(self.start) or self.starts_inside):
            return 0
        if self.end not in text:  # thinking cut short
            return len(ids)
        lo, hi = 1, len(ids)  # the fewest tokens whose text holds the closing tag
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.end in tokenizer.decode(ids[:mid], skip_special_tokens=False) else (mid + 1, hi)
        return lo

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
            if text == self.parser.start:
                self._state = "reasoning"
                return "", ""
            if self.parser.start.startswith(text):  # "", "<th": not decided yet
                self._held = text
                return "", ""
            opened = text.startswith(self.parser.start)
            text = text.removeprefix(self.parser.start)
            self._state = "reasoning" if opened or self.parser.starts_inside else "content"
        if self._state == "content":
            return "", text
        reasoning, closed, content = text.partition(self.parser.end)
        if closed:
            self._state = "content"
            return reasoning, content
        keep = partial_suffix(text, self.parser.end)
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


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (kept back while streaming)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)
