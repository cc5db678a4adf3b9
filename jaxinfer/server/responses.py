"""OpenAI's Responses API (`POST /v1/responses`) over the chat endpoint.

A request becomes a chat completion (`to_chat`): `instructions` a system message, `input`
(a string, or messages and earlier `function_call` / `function_call_output` items) the
conversation, `text.format` the response format, function `tools` and `tool_choice` the
same fields of chat. The chat answer becomes a response (`to_response`): a `message` item
holding `output_text`, or `function_call` items. Streamed, the chat chunks become the
Responses events (`ResponseEvents`): `response.created`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ... `response.completed`.

Responses are kept in memory (`ResponseStore`; OpenAI's `store`, on unless a request says
`"store": false`), so `previous_response_id` continues a conversation and `GET` / `DELETE
/v1/responses/{id}` (and `.../input_items`) find them, until the server restarts or the store's
capacity pushes the oldest out. A `background` request is answered at once ("queued") and
generated on; `GET` shows it "in_progress" until it ends, `POST .../cancel` stops it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from jaxinfer.server.protocol import Body, ChatCompletionRequest, ErrorBody, new_id, now

TEXT_PARTS = ("input_text", "output_text", "text")  # content parts that are text
# chat fields a response request may also send; the rest have Responses' own names, or would
# make an answer a response cannot hold (n choices, chat-shaped logprobs)
CHAT_EXTRAS = frozenset(ChatCompletionRequest.model_fields) - {
    "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "tools", "tool_choice",
    "response_format", "logprobs", "top_logprobs", "model", "user", "temperature", "top_p", "parallel_tool_calls"}


class ResponsesRequest(Body):
    """The fields of `POST /v1/responses` this server serves (others are ignored)."""

    # other fields pass to the chat request where chat has them (vLLM's extras: top_k, seed,
    # structured_outputs, ...; `CHAT_EXTRAS`), else they are ignored
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None  # function tools: {"type": "function", "name", "parameters", ...}
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False  # answer at once ("queued") and generate on; poll GET /v1/responses/{id}
    metadata: dict[str, str] | None = None
    user: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # alternatives per output token (with their logprobs)
    include: list[str] | None = None  # "message.output_text.logprobs": the output tokens' logprobs

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or ())

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items: a text is one user message."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def to_chat(self, history: list[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The chat completion this asks for, after the items of `history` (the conversation of
        `previous_response_id`); ErrorBody 400 naming the field if it cannot be."""
        chat: dict[str, Any] = {"messages": self._messages(list(history)), "stream": self.stream,
                                "stream_options": {"include_usage": True} if self.stream else None}
        chat |= {name: getattr(self, name) for name in ("temperature", "top_p") if name in self.model_fields_set}
        chat |= {name: value for name, value in (self.model_extra or {}).items() if name in CHAT_EXTRAS}
        for name in ("model", "user", "parallel_tool_calls"):
            if (value := getattr(self, name)) is not None:
                chat[name] = value
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        if self.wants_logprobs:
            chat |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            chat["tools"] = [self._tool(i, tool) for i, tool in enumerate(self.tools)]
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or not isinstance(self.tool_choice.get("name"), str):
                raise ErrorBody(400, 'tool_choice: a chosen function is {"type": "function", "name": ...}',
                                param="tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.get("name")}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise ErrorBody(400, "text.format: type 'json_schema' needs its schema (an object) under 'schema'",
                                param="text.format.schema")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}}
        elif fmt.get("type") in ("json_object", "text"):
            chat["response_format"] = {"type": fmt["type"]}
        else:
            raise ErrorBody(400, f"text.format: type {fmt.get('type')!r} must be 'text', 'json_object' or "
                                 "'json_schema'", param="text.format")
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:
            first = e.errors()[0]
            field = str(first["loc"][0]) if first.get("loc") else None
            raise renamed(ErrorBody(400, f"{field}: {first.get('msg')}", param=field)) from None

    def _messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # an earlier response's instructions are not carried over (OpenAI's rule): only this one's
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        thinking: dict[str, str] = {}  # a reasoning item's text, for the assistant turn after it
        # (history's items were checked when they were stored: indices < 0 never reach an error)
        for i, item in enumerate(history + self.input_items(), start=-len(history)):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                messages.append({"role": role, "content": _text(item.get("content"), f"input.{i}.content")}
                                | (thinking if role == "assistant" else {}))
                thinking = {}
            elif kind == "reasoning":  # an earlier answer's thinking, sent back as clients do
                thinking = {"reasoning_content": _reasoning_text(item, f"input.{i}")}
            elif kind == "function_call":  # an earlier call: joins the assistant message before it, if any
                if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                    raise ErrorBody(400, f"input.{i}: a function_call needs its name and call_id", param=f"input.{i}")
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last and not thinking:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]} | thinking)
                thinking = {}
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str) else json.dumps(output)})
            else:
                raise ErrorBody(400, f"input.{i}: items of type {kind!r} are not supported (message, reasoning, "
                                     "function_call, function_call_output are)", param=f"input.{i}.type")
        return messages

    @staticmethod
    def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
        if tool.get("type") != "function":
            raise ErrorBody(400, f"tools.{i}: type {tool.get('type')!r} is not supported (function tools are)",
                            param=f"tools.{i}.type")
        return {"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters", "strict")
                                                 if key in tool}}

    def echo(self) -> dict[str, Any]:
        """The request's settings a response repeats."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "tools": self.tools or [],
                "tool_choice": self.tool_choice or "auto", "parallel_tool_calls": self.parallel_tool_calls is not False,
                "text": self.text or {"format": {"type": "text"}}, "metadata": self.metadata or {},
                "previous_response_id": self.previous_response_id, "store": self.store, "user": self.user,
                "background": self.background, "top_logprobs": self.top_logprobs}


def _text(content: Any, param: str) -> str | None:
    """A message's content as text: a string, or its text parts joined (other parts refused)."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content if isinstance(content, list) else [content]):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ErrorBody(400, f"{param}.{j}: content of type {kind!r} is not supported (text is)", param=f"{param}.{j}")
        texts.append(part.get("text", ""))
    return "".join(texts)


def responses_id(prefix: str) -> str:
    """A Responses id, OpenAI's way: "resp_...", "msg_...", "fc_...", "rs_..."."""
    return new_id(prefix, sep="_")


# chat's field names -> Responses'
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                   "response_format": "text.format"}


def renamed(error: ErrorBody) -> ErrorBody:
    """A chat request's error in the names of the response request it came from."""
    message = re.sub(r"\b(" + "|".join(RESPONSES_NAMES) + r")\b", lambda m: RESPONSES_NAMES[m.group(1)], error.message)
    param = RESPONSES_NAMES.get(error.param, error.param)
    return ErrorBody(error.status, message, param, error.code, error.err_type, error.headers)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise ErrorBody(400, f"{param}: a reasoning item's content and summary are lists of {{'type', 'text'}} parts",
                        param=param)
    return "".join(p["text"] for p in parts)


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    reasoning = chat_usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat_usage["total_tokens"]}


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict[str, Any]:
    """status: "in_progress" (no content yet), "completed", or "incomplete" (cut short at max_output_tokens).
    `logprobs`: per output token {"token", "logprob", "bytes", "top_logprobs"} (chat's entries)."""
    content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                   "logprobs": logprobs or []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's thinking (the chat message's `reasoning_content`, with a reasoning parser)."""
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": "" if status == "in_progress" else call["function"]["arguments"], "status": status}


def item_status(finish_reason: str | None) -> str:
    """The status of the items a finished choice wrote: cut short at its token limit or not."""
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(response_id: str, created: int, model: str, request: ResponsesRequest,
                    output: list[dict[str, Any]], finish_reason: str | None, chat_usage: dict[str, int] | None) -> dict:
    """A response; `finish_reason` None: still in progress."""
    status = "in_progress" if finish_reason is None else item_status(finish_reason)
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "completed_at": now() if status == "completed" else None,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": None if chat_usage is None else usage(chat_usage)} | request.echo()


def to_response(request: ResponsesRequest, completion: dict[str, Any], response_id: str | None = None) -> dict[str, Any]:
    """A chat completion (one choice) as a response (a background one keeps the id it was given)."""
    choice = completion["choices"][0]
    message, output, status = choice["message"], [], item_status(choice["finish_reason"])
    if message.get("reasoning_content"):
        output.append(reasoning_item(responses_id("rs"), message["reasoning_content"], status))
    if message.get("content"):
        output.append(message_item(responses_id("msg"), message["content"], status,
                                   (choice.get("logprobs") or {}).get("content")))
    for call in message.get("tool_calls") or []:
        output.append(call_item(responses_id("fc"), call, status))
    return response_object(response_id or responses_id("resp"), completion["created"], completion["model"], request,
                           output, choice["finish_reason"], completion["usage"])


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # as it was answered
    input_items: list[dict[str, Any]]  # every item the model read: the earlier responses' and this input's

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one reads first: its input, then its output."""
        return self.input_items + self.response["output"]


class ResponseStore:
    """Responses kept for `previous_response_id` and `GET` / `DELETE /v1/responses/{id}`: in
    memory, the oldest dropped once more than `capacity` are kept (vLLM keeps them all)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._generating: set[asyncio.Task] = set()  # background responses' tasks (asyncio keeps only weak refs)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        items = [item if "id" in item else {"id": responses_id("msg" if item.get("type", "message") == "message"
                                                               else "item")} | item for item in input_items]
        self._kept[response["id"]] = StoredResponse(response, items)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        if (stored := self._kept.get(response_id)) is None:
            raise ErrorBody(404, f"Response with id {response_id!r} not found (this server keeps responses in memory, "
                                 f"the newest {self.capacity}, and none created with store false).", param=param)
        return stored

    def discard(self, response_id: str) -> None:
        """Forget a response that was refused after it was put (no error if it is not kept)."""
        self._kept.pop(response_id, None)

    def delete(self, response_id: str) -> dict[str, Any]:
        self.get(response_id)
        del self._kept[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    def generate(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run a background response's `work`, held until it ends."""
        task = asyncio.create_task(work)
        self._generating.add(task)
        task.add_done_callback(self._generating.discard)
        return task

    def wanted(self, response_id: str) -> bool:
        """Whether a response's generation should go on: kept, and not cancelled."""
        return (stored := self._kept.get(response_id)) is not None and stored.response["status"] != "cancelled"

    def finish(self, response_id: str, response: dict[str, Any]) -> None:
        """A response's final state (unless it was cancelled or deleted meanwhile)."""
        if self.wanted(response_id):
            self._kept[response_id] = StoredResponse(response, self._kept[response_id].input_items)

    def cancel(self, response_id: str) -> dict[str, Any]:
        """OpenAI's cancel: a background response still generating reads "cancelled" (its
        generation stops: `wanted`); one that has finished is returned as it is."""
        stored = self.get(response_id)
        if not stored.response.get("background"):
            raise ErrorBody(400, f"response {response_id!r} was not created with background: true; only those can "
                                 "be cancelled", param="response_id")
        if stored.response["status"] in ("queued", "in_progress"):
            self._kept[response_id] = StoredResponse(stored.response | {"status": "cancelled"}, stored.input_items)
        return self._kept[response_id].response

    def input_items(self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        """OpenAI's list of a response's input items (`client.responses.input_items.list`)."""
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise ErrorBody(400, "order is 'asc' or 'desc' and limit between 1 and 100", param="order")
        items = self.get(response_id).input_items[::-1 if order == "desc" else 1]
        ids = [item["id"] for item in items]
        if after is not None:
            if after not in ids:
                raise ErrorBody(404, f"after: no input item {after!r} in response {response_id!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = [_item_shape(item) for item in items[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _item_shape(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it: a message's content as typed parts."""
    if item.get("type", "message") != "message":
        return item
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {"type": "message", "status": "completed"} | item | {"content": content or []}


class ResponseEvents:
    """Chat chunks (one choice) -> Responses stream events."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request, self.model = request, model
        self.id, self.created = responses_id("resp"), now()
        self.output: list[dict[str, Any]] = []  # items, completed as they close
        self._open: dict[str, Any] | None = None  # the item being written: message or function call
        self._calls: dict[int, int] = {}  # tool-call index -> its item's output index
        self._sequence = 0
        self._finish: str | None = None
        self._error: dict[str, Any] | None = None  # the error object, if the chat stream sent one
        self.final: dict[str, Any] | None = None  # the response, once the stream completed

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence} | fields  # from 0, as OpenAI counts
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _response(self, usage_: dict[str, int] | None = None) -> dict[str, Any]:
        return response_object(self.id, self.created, self.model, self.request, self.output, self._finish, usage_)

    def snapshot(self, ended: bool = True) -> dict[str, Any]:
        """The response as far as it got: the final one, "failed" after an error, else
        "cancelled" once `ended` (the client left) or "in_progress"."""
        if self.final is not None:
            return self.final
        if self._error is not None:
            return self._response() | {"status": "failed", "error": {"code": self._error.get("code"),
                                                                      "message": self._error.get("message")}}
        if not ended:
            return self._response()
        self._close("incomplete")  # the item being written, as far as it got
        return self._response() | {"status": "cancelled"}

    def start(self) -> list[str]:
        return [self._event("response.created", response=self._response()),
                self._event("response.in_progress", response=self._response())]

    def chunk(self, data: dict[str, Any]) -> list[str]:
        """The events of one chat chunk (an error object becomes an `error` event)."""
        if "error" in data:
            error = self._error = data["error"]
            return [self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))]
        events = []
        for choice in data.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"], (choice.get("logprobs") or {}).get("content") or [])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                events += self._close(item_status(self._finish))
        if data.get("usage") is not None:
            kind = "response.incomplete" if self._finish == "length" else "response.completed"
            self.final = self._response(data["usage"])
            events.append(self._event(kind, response=self.final))
        return events

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[str]:
        return self._written("message", text, logprobs)

    def _reasoning(self, text: str) -> list[str]:
        return self._written("reasoning", text)

    def _written(self, kind: str, text: str, logprobs: list[dict[str, Any]] = ()) -> list[str]:
        """`text` added to the open item of `kind` ("message" or "reasoning"), opened first."""
        message = kind == "message"
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            item = (message_item(responses_id("msg"), "", status="in_progress") if message else
                    reasoning_item(responses_id("rs"), "", status="in_progress"))
            self._open = item | {"text": "", "logprobs": []}
            index = len(self.output)
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            if message:
                events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                          content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self._open["text"] += text
        self._open["logprobs"] += logprobs
        delta = (("response.output_text.delta", {"logprobs": list(logprobs)}) if message else
                 ("response.reasoning_text.delta", {}))
        return events + [self._event(delta[0], item_id=self._open["id"], output_index=len(self.output), content_index=0,
                                     delta=text, **delta[1])]

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        if call["index"] not in self._calls:  # a call's first delta: its id and name
            events += self._close()
            item = call_item(responses_id("fc"), call, status="in_progress")
            self._calls[call["index"]] = len(self.output)
            self._open = item
            events.append(self._event("response.output_item.added", output_index=len(self.output), item=item))
        piece = call["function"].get("arguments") or ""
        if piece:
            self._open["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                      output_index=len(self.output), delta=piece))
        return events

    def _close(self, status: str = "completed") -> list[str]:
        """Finish the item being written (if any), as `status` (the last one may be incomplete)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output)
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], item["text"], status)
            events = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=item["text"])]
        elif item["type"] == "message":
            done = message_item(item["id"], item["text"], status, item["logprobs"])
            part = done["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=item["text"], logprobs=item["logprobs"]),
                      self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                  part=part)]
        else:
            done = item | {"status": status}
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"], name=item["name"])]
        self.output.append(done)
        return events + [self._event("response.output_item.done", output_index=index, item=done)]

    async def translate(self, chat_sse: AsyncIterator[str]) -> AsyncIterator[str]:
        """The chat stream's SSE lines -> this stream's."""
        for event in self.start():
            yield event
        async for line in chat_sse:
            if not line.startswith("data: {"):
                continue  # [DONE]: response.completed already went out with the usage
            for event in self.chunk(json.loads(line[len("data: "):])):
                yield event
