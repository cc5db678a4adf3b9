"""Chat templates: the model's jinja template, rendered in a sandbox as transformers does."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any


def text_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` checked, each as a dict whose `content` is a str: OpenAI's content parts
    (`[{"type": "text", "text": ...}, ...]`) are joined, as the server joins them; an assistant
    message that only calls tools may have none (`content: None`, as transformers takes it)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]['role'] must be a str, got {type(m.get('role')).__name__}")
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ValueError(f"messages[{i}]['content'][{j}] is of type {kind!r}: this model reads text parts only")
            content = "".join(part["text"] for part in content)
        elif not (isinstance(content, str) or (content is None and m.get("tool_calls"))):
            raise ValueError(f"messages[{i}]['content'] must be a str or a list of text parts, got {type(content).__name__}")
        out.append(dict(m) | {"content": content})
    return out


def compile_chat_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e


def read_chat_template(value: str) -> str:
    """A template given as vLLM's `--chat-template` takes it: the path of a file holding one
    (`.jinja`, or a `chat_template.json` / `tokenizer_config.json` with a `chat_template`), or
    the template itself. Compiled here, so a syntax error stops the command at
    start rather than the first chat request."""
    if "{{" in value or "{%" in value:
        source = value
    elif Path(value).is_file():
        source = Path(value).read_text(encoding="utf-8")
        if Path(value).suffix == ".json":
            try:
                source = json.loads(source)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"chat template file {value!r} is JSON without a 'chat_template' string") from None
            if isinstance(source, list):  # named templates (tokenizer_config.json): the default one
                source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
            if not isinstance(source, str):
                raise ValueError(f"chat template file {value!r}: 'chat_template' has no default template string")
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor a jinja template")
    compile_chat_template(source)
    return source
