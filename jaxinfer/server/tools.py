"""Function calling for `/v1/chat/completions`, as vLLM does it without a model-specific parser.

`tool_choice` names a function, or is "required": the output is constrained (structured
output, `jaxinfer.structured_output`) to that function's arguments, or to a JSON array of
`{"name", "parameters"}` calls of the listed tools, so every answer parses into `tool_calls`.
"none" answers in text, and so does "auto" (OpenAI's default when tools are sent): telling a
call apart in free text needs a parser of each model family's own call syntax, which this
server does not have (vLLM refuses "auto" without one; answering in text keeps clients that
send tools by default working).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

FREE_ARGUMENTS: dict[str, Any] = {"type": "object"}  # a function that declares no parameters


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


def constraint(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None) -> dict[str, Any] | None:
    """The structured-output fields (`{"json": schema, ...}`) a tool choice asks for, or None."""
    if not tools or tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": t.function.parameters or FREE_ARGUMENTS},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
    else:
        schema = next(t for t in tools if t.function.name == tool_choice.function.name).function.parameters
    # compact JSON, as OpenAI writes arguments: no tokens spent on layout
    return {"json": schema or FREE_ARGUMENTS, "disable_any_whitespace": True}


def parse_calls(text: str, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` of a constrained answer, or None if it does not parse (an answer
    cut short by max_tokens)."""
    if tool_choice == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False, separators=(",", ":"))) for c in calls]
    return [tool_call(tool_choice.function.name, text)]


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
