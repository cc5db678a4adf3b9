"""The OpenAI-compatible HTTP app: `/v1/models`, `/v1/completions`, `/v1/chat/completions`,
`/health`, `/metrics`. Handlers validate and tokenize on the event loop, hand the request
to the `EngineLoop` thread, and stream its `RequestOutput`s back (server-sent events)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.server.logprobs import chat_logprobs, completion_logprobs, tokens_of
from jaxinfer.server.loop import EngineLoop, QueueFull, Sink
from jaxinfer.server.protocol import (ChatCompletionRequest, CompletionRequest, ErrorBody, _Common, new_id, now,
                                      usage)

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class OpenAIServer:
    """State the handlers share: the engine loop, the tokenizer and the served model name."""

    def __init__(self, loop: EngineLoop, model_name: str, api_key: str | None = None):
        self.loop = loop
        self.model_name = model_name
        self.api_key = api_key
        self.tokenizer = loop.engine.model.tokenizer
        self.max_model_len = loop.engine.max_model_len

    # ---- validation and tokenization ----------------------------------------------------------

    def check_model(self, body: _Common) -> None:
        if body.model != self.model_name:
            raise ErrorBody(400, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                            param="model", code="model_not_found")

    def completion_ids(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ErrorBody(400, f"prompt: a list of {len(prompt)} prompts is not supported; send one", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._tokenizer("prompt").encode(prompt)
        else:
            ids = list(prompt)
        return self._check_length(ids, "prompt")

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        tok = self._tokenizer("messages")
        try:
            text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as e:
            raise ErrorBody(400, f"messages: {e}", param="messages") from e
        return self._check_length(tok.encode(text, add_special_tokens=False), "messages")

    def _tokenizer(self, param: str):
        if self.tokenizer is None:
            raise ErrorBody(400, f"{param}: this model has no tokenizer; send token ids", param=param)
        return self.tokenizer

    def _check_length(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ErrorBody(400, f"{param} is empty", param=param)
        if len(ids) >= self.max_model_len:
            raise ErrorBody(400, f"{param} has {len(ids)} tokens; the context is {self.max_model_len} tokens "
                                 "(prompt + at least one generated token)", param=param, code="context_length_exceeded")
        return ids

    def params(self, body: _Common, ids: list[int], default_max_tokens: int | None):
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise ErrorBody(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if body.num_logprobs is not None:
            self._tokenizer("logprobs")  # token strings need it
        if getattr(body, "echo", False):
            raise ErrorBody(400, "echo is not supported by this server", param="echo")
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None and body.max_tokens is None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        try:
            return body.sampling_params(default_max_tokens or self.max_model_len - len(ids))
        except ValueError as e:
            raise ErrorBody(400, str(e), param=_field_of(str(e))) from e

    # ---- running a request ----------------------------------------------------------------------

    async def submit(self, ids: list[int], params, salt: str | None) -> tuple[Sink, list[str]]:
        sink = Sink(asyncio.get_running_loop())
        try:
            rids = self.loop.submit(ids, params, salt, sink)
        except QueueFull as e:
            self.loop.stats.reject("queue_full")
            raise ErrorBody(429, f"server busy: {e}; retry later", code="queue_full", err_type="rate_limit_error",
                            headers={"Retry-After": "1"}) from e
        kind, payload = await sink.get()
        if kind == "error":
            message = str(payload)
            param = ("max_tokens" if message.startswith("prompt of") else
                     "prompt" if message.startswith("prompt") else _field_of(message))
            raise ErrorBody(400, message, param=param)
        return sink, rids

    async def events(self, raw: Request, sink: Sink, rids: list[str]) -> AsyncIterator[tuple]:
        """Yield ("output", index, RequestOutput) until every choice has finished. Aborts the
        remaining choices if the client goes away (or the consumer stops early)."""
        left = len(rids)
        try:
            while left:
                try:
                    event = await asyncio.wait_for(sink.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        return
                    continue
                if event[0] == "error":
                    raise ErrorBody(500, f"engine error: {event[1]}", err_type="server_error")
                if event[0] == "aborted":
                    left -= 1
                    yield ("aborted", event[1], None)
                    continue
                if event[2].finished:
                    left -= 1
                yield event
        finally:
            if left:
                self.loop.abort(rids)


def _field_of(message: str) -> str | None:
    """The field a ValueError message names: 'top_p=1.5 must be ...' -> 'top_p'."""
    m = re.match(r"\s*([A-Za-z_]+)\s*(=|:| must| is)", message)
    return m.group(1) if m else None


# ---- endpoints ----------------------------------------------------------------------------------


async def completions(server: OpenAIServer, raw: Request, body: CompletionRequest):
    server.check_model(body)
    ids = server.completion_ids(body)
    params = server.params(body, ids, default_max_tokens=16)
    sink, rids = await server.submit(ids, params, body.salt)
    rid, created = new_id("cmpl"), now()

    def chunk(choices, use=None):
        d = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name, "choices": choices}
        if body.include_usage:
            d["usage"] = use
        return d

    wants_logprobs = body.num_logprobs is not None

    def logprobs(out, offset=0, new_only=True):
        if not wants_logprobs:
            return None, offset
        return completion_logprobs(server.tokenizer, *tokens_of(out, new_only), offset)

    if body.stream:
        async def stream():
            generated, offsets = 0, [0] * len(rids)
            async for _, index, out in server.events(raw, sink, rids):
                if out is None:
                    continue
                generated += len(out.delta_token_ids)
                if out.delta_text or out.finished or (wants_logprobs and out.delta_token_ids):
                    lp, offsets[index] = logprobs(out, offsets[index])
                    yield _sse(chunk([{"index": index, "text": out.delta_text, "logprobs": lp,
                                       "finish_reason": out.finish_reason if out.finished else None}]))
            if body.include_usage:
                yield _sse(chunk([], usage(len(ids), generated)))
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    finals = await _collect(server, raw, sink, rids)
    choices = [{"index": i, "text": o.text, "logprobs": logprobs(o, new_only=False)[0], "finish_reason": o.finish_reason}
               for i, o in finals]
    return {"id": rid, "object": "text_completion", "created": created, "model": server.model_name,
            "choices": choices, "usage": usage(len(ids), sum(len(o.token_ids) for _, o in finals))}


async def chat_completions(server: OpenAIServer, raw: Request, body: ChatCompletionRequest):
    server.check_model(body)
    ids = server.chat_ids(body)
    params = server.params(body, ids, default_max_tokens=None)
    sink, rids = await server.submit(ids, params, body.salt)
    rid, created = new_id("chatcmpl"), now()

    def chunk(choices, use=None):
        d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": server.model_name,
             "choices": choices}
        if body.include_usage:
            d["usage"] = use
        return d

    def logprobs(out, new_only=True):
        return chat_logprobs(server.tokenizer, *tokens_of(out, new_only)) if body.logprobs else None

    if body.stream:
        async def stream():
            for i in range(len(rids)):
                yield _sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]))
            generated = 0
            async for _, index, out in server.events(raw, sink, rids):
                if out is None:
                    continue
                generated += len(out.delta_token_ids)
                if out.delta_text or (body.logprobs and out.delta_token_ids):
                    yield _sse(chunk([{"index": index, "delta": {"content": out.delta_text}, "logprobs": logprobs(out),
                                       "finish_reason": None}]))
                if out.finished:
                    yield _sse(chunk([{"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": out.finish_reason}]))
            if body.include_usage:
                yield _sse(chunk([], usage(len(ids), generated)))
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    finals = await _collect(server, raw, sink, rids)
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text}, "logprobs": logprobs(o, new_only=False),
                "finish_reason": o.finish_reason} for i, o in finals]
    return {"id": rid, "object": "chat.completion", "created": created, "model": server.model_name,
            "choices": choices, "usage": usage(len(ids), sum(len(o.token_ids) for _, o in finals))}


async def _collect(server: OpenAIServer, raw: Request, sink: Sink, rids: list[str]):
    """The final output of every choice, in index order (empty if the client left)."""
    finals = {}
    async for _, index, out in server.events(raw, sink, rids):
        if out is not None and out.finished:
            finals[index] = out
    return sorted(finals.items())


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---- the app ------------------------------------------------------------------------------------


def create_app(server: OpenAIServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    _add_error_handlers(app)
    _add_auth(app, server.api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.loop.stats.render(server.loop.snapshot, server.loop.outstanding),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxinfer",
                "max_model_len": server.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def post_completions(body: CompletionRequest, raw: Request):
        return await completions(server, raw, body)

    @app.post("/v1/chat/completions")
    async def post_chat(body: ChatCompletionRequest, raw: Request):
        return await chat_completions(server, raw, body)

    return app


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           err_type: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse(ErrorBody(status, message, param, code, err_type).body(), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ErrorBody)
    async def on_error(_, e: ErrorBody):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid" or param is None:
            return _error(400, f"the body must be a JSON object: {first.get('msg')}", code="invalid_json")
        return _error(400, f"{param or 'body'}: {first.get('msg')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), err_type="invalid_request_error" if e.status_code < 500 else "server_error")


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                          code="invalid_api_key", err_type="authentication_error")
        return await call_next(request)
