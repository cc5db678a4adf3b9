"""Function calling for `/v1/chat/completions` (and `/v1/responses`), as vLLM does it.

`tool_choice` names a function, or is "required": the output is constrained (structured
output, `jaxinfer.structured_output`) to that function's arguments, or to a JSON array of
`{"name", "parameters"}` calls of the listed tools (`RequiredCalls` reads it as it streams),
so every answer parses into `tool_calls`. "none" answers in text, and so does "auto" (OpenAI's default when tools are sent) unless the
server has a parser of the model family's own call syntax (`jaxinfer serve --tool-call-parser
hermes` or `llama3_json`, as in vLLM): then the calls the model writes in its text come back
as `tool_calls` (`TextCalls`). Without one, "auto" answers in text (vLLM refuses it; answering keeps
clients that send tools by default working).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jaxinfer.reasoning import partial_suffix
from jaxinfer.structured_output import StructuredOutputsParams, strict_schema


# a function that declares no parameters takes none (OpenAI: "an empty parameter list")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# `tool_choice` below: None, "none", "auto", "required" or a `protocol.NamedToolChoice`


def check_tools(tools: list | None, tool_choice: Any) -> None:
    """A ValueError naming the field when `tools` / `tool_choice` cannot be served."""
    names = [t.function.name for t in tools or ()]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not tools:
        raise ValueError(f"tool_choice: {_show(tool_choice)} needs tools")
    if not isinstance(tool_choice, str) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice: function {tool_choice.function.name!r} is not among tools {names}")
    for i, tool in enumerate(tools):  # each schema the constraint holds, alone: an error names its tool
        if tool_choice == "required" or tool.function.name == tool_choice.function.name:
            try:
                StructuredOutputsParams(json=arguments_schema(tool.function),
                                        ignore_unsupported_keywords=not tool.function.strict).grammar_text()
            except ValueError as e:
                raise ValueError(f"tools.{i}.function.parameters: {str(e).removeprefix('structured_outputs.json: ')}"
                                 ) from None


def constraint(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None) -> dict[str, Any] | None:
    """The structured-output fields (`{"json": schema, ...}`) a tool choice asks for, or None."""
    if not tools or tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": arguments_schema(t.function)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
    else:
        schema = arguments_schema(next(t for t in tools if t.function.name == tool_choice.function.name).function)
    # compact JSON, as OpenAI writes arguments: no tokens spent on layout; keywords the grammar
    # cannot enforce refused only for strict functions (OpenAI's strict mode refuses them too)
    used = tools if tool_choice == "required" else [t for t in tools if t.function.name == tool_choice.function.name]
    return {"json": schema, "disable_any_whitespace": True,
            "ignore_unsupported_keywords": not any(t.function.strict for t in used)}


def arguments_schema(function: Any) -> dict[str, Any]:
    """A function's arguments schema (an empty object if it declares none), closed where it is strict."""
    schema = function.parameters or NO_ARGUMENTS
    return strict_schema(schema) if function.strict else schema


def parse_calls(text: str, tool_choice: Any) -> list[dict[str, Any]]:
    """The OpenAI `tool_calls` of a constrained answer; one cut short by max_tokens gives what
    its stream gives: the calls named so far, their arguments as far as written."""
    if tool_choice == "required":
        return RequiredCalls.parse(text)
    return [tool_call(tool_choice.function.name, text)]


class RequiredCalls:
    """The calls of a "required" answer, a JSON array of `{"name", "parameters"}` objects
    (`constraint`), read as the model writes it: `feed` returns OpenAI's streamed
    `tool_calls` deltas, a call's id and name once its name is complete, then its arguments
    (the `parameters` value as written) piece by piece. A small scanner of JSON's nesting and
    strings; the grammar guarantees the text is JSON of that shape, cut short at worst."""

    def __init__(self) -> None:
        self._text = ""
        self._depth = 0  # brackets and braces open: 1 in the array, 2 in a call object
        self._in_string = self._escaped = False
        self._string_start = 0
        self._expect_key = False  # in a call object, the next string is a key
        self._key: str | None = None  # the key whose value is being read
        self._calls: list[dict[str, Any]] = []  # {"name", "start" of its arguments, "end", "sent"}
        self.closed = False  # the array is complete

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The `tool_calls` deltas `text` completes (each with its call's `index`)."""
        begin = len(self._text)
        self._text += text
        for i in range(begin, len(self._text)):
            self._scan(i, self._text[i])
        return [delta for index, call in enumerate(self._calls) for delta in self._deltas(index, call)]

    def _scan(self, i: int, ch: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 2:
                    self._string_done(json.loads(self._text[self._string_start : i + 1]))
        elif ch == '"':
            self._in_string, self._string_start = True, i
        elif ch in "[{":
            self._depth += 1
            if self._depth == 2:
                self._calls.append({"name": None, "start": None, "end": None, "sent": -1})
                self._expect_key = True
        elif ch in "]}" or (ch == "," and self._depth == 2):
            if self._depth == 2:  # a value of the call object ends here
                call = self._calls[-1]
                if self._key == "parameters" and call["end"] is None:
                    call["end"] = i
                self._key, self._expect_key = None, ch == ","
            if ch != ",":
                self._depth -= 1
                self.closed = self._depth == 0
        elif ch == ":" and self._depth == 2 and self._key == "parameters":
            self._calls[-1]["start"] = i + 1

    def _string_done(self, value: str) -> None:
        if self._expect_key:
            self._key, self._expect_key = value, False
        elif self._key == "name":
            self._calls[-1]["name"] = value

    def _deltas(self, index: int, call: dict[str, Any]) -> list[dict[str, Any]]:
        if call["name"] is None:
            return []  # held until the name is known (it may follow the arguments)
        out = []
        if call["sent"] < 0:
            out.append(tool_call(call["name"], "", index))
            call["sent"] = 0
        if call["start"] is not None:
            end = len(self._text) if call["end"] is None else call["end"]
            piece = self._text[call["start"] + call["sent"] : end]
            if piece:
                out.append({"index": index, "function": {"arguments": piece}})
                call["sent"] += len(piece)
        return out

    @classmethod
    def parse(cls, text: str) -> list[dict[str, Any]]:
        """A whole answer's calls, as its stream's deltas add up: those whose name is complete,
        each with its arguments as far as written (all of them, whole, in a complete answer)."""
        reader = cls()
        reader.feed(text)
        return [tool_call(c["name"], "" if c["start"] is None else text[c["start"] : c["end"]])
                for c in reader._calls if c["name"] is not None]


def tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index} | call


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's earlier calls with their arguments
    as objects (templates write them with `tojson`; OpenAI sends them as JSON text)."""
    calls = message.get("tool_calls")
    return message | {"tool_calls": [_arguments_loaded(c) for c in calls]} if calls else message


def _arguments_loaded(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass  # not JSON: the template gets the text as sent
    return call | {"function": function}


def _show(tool_choice: Any) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else repr(tool_choice.function.name)


class TextCalls:
    """Tool calls a model writes in its answer's text, in its family's own syntax (tool choice
    "auto" with `--tool-call-parser`). Fed a choice's text as it streams (`feed`, then
    `finish`), a parser returns what to send: content, and each call once complete (OpenAI
    call objects with their `index`). What does not parse as a call stays in the content as
    written: nothing the model wrote is lost."""

    def __init__(self) -> None:
        self.calls = 0  # calls returned so far: the next one's index
        self._blank = ""  # `stream`: trailing whitespace held back

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, calls completed now)."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the answer: what was held back, as content or calls."""
        raise NotImplementedError

    def _call(self, fields: Any) -> dict[str, Any] | None:
        """The next call from its JSON (`{"name": str, "arguments" or "parameters": object or
        JSON text}`), or None if it is not one."""
        if not isinstance(fields, dict) or not isinstance(fields.get("name"), str):
            return None
        arguments = fields.get("arguments", fields.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        self.calls += 1
        return tool_call(fields["name"], arguments, self.calls - 1)

    def stream(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """`feed` (and at the end `finish`) for a stream whose content ends as `parse` gives it:
        trailing whitespace waits for more content, and is dropped at the end of an answer
        with calls (the line breaks around a call are not content)."""
        content, calls = self.feed(text)
        if finished:
            rest, last = self.finish()
            content, calls = content + rest, calls + last
        content, self._blank = self._blank + content, ""
        if finished and not self.calls:
            return content, calls
        kept = content.rstrip()
        self._blank = "" if finished else content[len(kept):]
        return kept, calls

    @classmethod
    def parse(cls, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer -> (its content without the calls, None if only whitespace is left
        and there were calls; the calls, without their stream `index`)."""
        parser = cls()
        content, calls = parser.feed(text)
        rest, last = parser.finish()
        content, calls = content + rest, [{k: v for k, v in c.items() if k != "index"} for c in calls + last]
        return (None if calls and not content.strip() else content.strip() if calls else content), calls


class HermesCalls(TextCalls):
    """Calls written as Hermes, Qwen 2.5 / 3 and SmolLM3 write them, anywhere in the text:

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    Content is held back only while it might be the start of `<tool_call>`; a block that does
    not hold a call stays in the content; a last block left open is a call if what it holds is
    one (the answer stopped at EOS or a stop string right after it)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text not yet sent: a possible start tag, or an open block

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        buffer, content, calls = self._pending + text, [], []
        while True:
            start = buffer.find(self.START)
            if start < 0:
                keep = partial_suffix(buffer, self.START)
                content.append(buffer[: len(buffer) - keep])
                self._pending = buffer[len(buffer) - keep :]
                break
            end = buffer.find(self.END, start)
            if end < 0:
                content.append(buffer[:start])
                self._pending = buffer[start:]
                break
            call = self._call(_json_or_none(buffer[start + len(self.START) : end]))
            if call is None:
                content.append(buffer[: end + len(self.END)])
            else:
                content.append(buffer[:start])
                calls.append(call)
            buffer = buffer[end + len(self.END) :]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        pending, self._pending = self._pending, ""
        if pending.startswith(self.START) and (call := self._call(_json_or_none(pending[len(self.START) :]))):
            return "", [call]
        return pending, []


class Llama3JsonCalls(TextCalls):
    """Calls written as Llama 3.1 / 3.2 write them with JSON tool calling: the whole answer is
    one call or several separated by ";", optionally after `<|python_tag|>`:

        {"name": "get_weather", "parameters": {"city": "Paris"}}

    An answer that begins otherwise streams as content at once; one that begins like a call
    is held to its end, then returned as calls if every part is one, else as content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._content = False  # decided: the answer is text

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._content:
            return text, []
        self._held += text
        head = self._held.lstrip()
        if not head or (len(head) < len(self.TAG) and self.TAG.startswith(head)):
            return "", []  # not decided yet
        if head.startswith((self.TAG, "{")):
            return "", []  # a call: held to the end
        self._content, held, self._held = True, self._held, ""
        return held, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        held, self._held = self._held, ""
        body, decoder, parts = held.strip().removeprefix(self.TAG), json.JSONDecoder(), []
        position = 0
        while (position := _skip(body, position, " \n\t;")) < len(body):
            try:
                fields, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return held, []
            parts.append(fields)
        if not parts or not all(isinstance(p, dict) and isinstance(p.get("name"), str) for p in parts):
            return held, []
        return "", [self._call(p) for p in parts]


def _skip(text: str, position: int, chars: str) -> int:
    while position < len(text) and text[position] in chars:
        position += 1
    return position


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# `jaxinfer serve --tool-call-parser NAME` (vLLM's names)
TOOL_CALL_PARSERS: dict[str, type[TextCalls]] = {"hermes": HermesCalls, "llama3_json": Llama3JsonCalls}


def call_parser(name: str | None) -> type[TextCalls] | None:
    """The parser named `name` (None: none); a ValueError names the choices."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r}: the parsers are {', '.join(TOOL_CALL_PARSERS)}")
    return None if name is None else TOOL_CALL_PARSERS[name]
