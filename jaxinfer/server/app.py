"""The OpenAI-compatible HTTP app: `/v1/models`, `/v1/completions`, `/v1/chat/completions`,
`/health`, `/metrics`. Handlers validate and tokenize on the event loop, hand the request
to the `EngineLoop` thread, and stream its `RequestOutput`s back (server-sent events).

Every error reaches the client in the OpenAI shape `{"error": {message, type, param, code}}`:
input the server cannot serve is a 400 naming the field; a failure of the server itself is a
500 (`server_error`) whose message carries the request id it is logged under (also sent as
the `x-request-id` header). Once a stream has started, an error arrives as an SSE event
holding that object, followed by `data: [DONE]`. A client that disconnects, streaming or not,
has its request aborted (its pages return to the pool), with or without an API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxinfer import __version__
from jaxinfer.loading import sampling_defaults
from jaxinfer.sampling import truncate_prompt
from jaxinfer.scoring import score_tokens
from jaxinfer.server.logprobs import chat_logprobs, completion_logprobs, join_logprobs, tokens_of, vllm_prompt_logprobs
from jaxinfer.server.loop import EngineLoop, QueueFull, Sink
from jaxinfer.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                      ErrorBody, TokenizeRequest, _Common, new_id, now, usage)
from jaxinfer.reasoning import find_reasoning_parser
from jaxinfer.server.responses import (ResponseEvents, ResponsesRequest, ResponseStore, renamed, response_object,
                                       responses_id, to_response)
from jaxinfer.server.tools import RequiredCalls, call_parser, parse_calls, tool_call

T = TypeVar("T")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
DONE = "data: [DONE]\n\n"
WARMING_RETRY_AFTER_S = 5  # what /health's Retry-After suggests while the engine compiles

logger = logging.getLogger(__name__)


class OpenAIServer:
    """State the handlers share: the engine loop, the tokenizer and the served model names
    (the first is the one `/v1/models` lists first and responses to requests naming none carry)."""

    def __init__(self, loop: EngineLoop, model_name: str | Sequence[str], api_key: str | None = None,
                 tool_call_parser: str | None = None, allowed_origins: Sequence[str] = ("*",),
                 reasoning_parser: str | None = None, generation_config: str = "auto"):
        self.tool_call_parser = call_parser(tool_call_parser)  # "auto" tool choice: calls read from the text
        self.reasoning_parser = find_reasoning_parser(reasoning_parser)  # thinking split from the answer
        self.loop = loop
        self.model_names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        if not self.model_names:
            raise ValueError("an OpenAIServer needs at least one served model name")
        self.api_key = api_key
        self.responses = ResponseStore()  # `/v1/responses` answers, for `previous_response_id`
        self.allowed_origins = list(allowed_origins)  # CORS: the web pages whose scripts may call the API
        self.tokenizer = loop.engine.model.tokenizer
        self.max_model_len = loop.engine.max_model_len
        # the defaults of what requests leave out (vLLM's --generation-config): "auto" the model's
        # generation_config.json, "vllm" none (the API's own), or a directory holding one
        check_generation_config(generation_config)
        self.sampling_defaults = (loop.engine.model.generation_config if generation_config == "auto" else
                                  {} if generation_config == "vllm" else sampling_defaults(generation_config))

    # ---- validation and tokenization ----------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, body: _Common | TokenizeRequest | DetokenizeRequest) -> str:
        """The served name a request asked for (the first when it names none, as vLLM allows);
        an unknown name is a 404 `model_not_found`, as OpenAI and vLLM answer it."""
        if body.model is None:
            return self.model_name
        if body.model not in self.model_names:
            served = ", ".join(map(repr, self.model_names))
            raise ErrorBody(404, f"model {body.model!r} does not exist; this server serves {served}",
                            param="model", code="model_not_found")
        return body.model

    def completion_prompts(self, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """Each prompt of a completion request as (its text as sent, or None for token ids; its
        ids). `prompt` is one text, one list of ids, or a batch of either (OpenAI's forms)."""
        prompt = body.prompt
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if len(batch) * body.n > self.loop.max_outstanding:  # more than the server ever holds: no retry helps
            raise ErrorBody(400, f"prompt: a batch of {len(batch)} prompts x n={body.n} choices; this server holds at "
                                 f"most {self.loop.max_outstanding} requests", param="prompt")
        prompts, generating, vocab = [], body.max_tokens != 0, self.loop.engine.model.config.vocab_size
        for one in batch:
            if isinstance(one, str):
                special = body.add_special_tokens
                ids = self._tokenize("prompt", lambda tok: tok.encode(one, add_special_tokens=special))
            elif bad := [i for i in one if not 0 <= i < vocab]:  # checked here: echo decodes and scores them first
                raise ErrorBody(400, f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
            else:
                ids = list(one)
            ids = self._check_length(truncate_prompt(ids, body.truncate_prompt_tokens, self.max_model_len), "prompt",
                                     generating)
            prompts.append((one if isinstance(one, str) else None, ids))
        return prompts

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if body.chat_template is not None:  # a template is code the server would run: its operator's choice
            raise ErrorBody(400, "chat_template: this server does not take a template per request; start it with "
                                 "--chat-template", param="chat_template")
        tools = body.template_tools()
        options = body.template_options() | ({} if tools is None else {"tools": tools})
        ids = self.messages_ids(body.messages, options)
        return self._check_length(truncate_prompt(ids, body.truncate_prompt_tokens, self.max_model_len), "messages")

    def messages_ids(self, messages: list[ChatMessage], options: dict[str, Any]) -> list[int]:
        """The token ids of `messages` rendered with the chat template; `options` are
        `apply_chat_template`'s keywords (`ChatTemplateOptions.template_options`, tools)."""
        turns = [m.template_fields() for m in messages]
        return self._tokenize("messages", lambda tok: tok.encode(tok.apply_chat_template(turns, **options),
                                                                 add_special_tokens=False))

    def tokenize(self, body: TokenizeRequest) -> dict:
        """`POST /tokenize` (vLLM's): the ids a prompt or chat would be served with."""
        self.check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise ErrorBody(400, "send exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            ids = self._tokenize("prompt", lambda tok: tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            ids = self.messages_ids(body.messages, body.template_options())
        strs = [self.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """`POST /detokenize` (vLLM's): the text of token ids, special tokens included unless
        `skip_special_tokens` (so a chat prompt from `/tokenize` comes back as rendered)."""
        self.check_model(body)
        return {"prompt": self._tokenize("tokens", lambda tok: tok.decode(body.tokens, body.skip_special_tokens))}

    def _tokenize(self, param: str, encode: Callable[[Any], T]) -> T:
        """`encode(tokenizer)` (or decode). What the tokenizer or chat template refuses (text
        that is not valid Unicode, a template's raise_exception, an id outside the vocabulary)
        is the input's fault: a 400 naming `param`."""
        tok = self._tokenizer(param)
        try:
            return encode(tok)
        except (ValueError, TypeError) as e:
            raise ErrorBody(400, f"{param}: {e}", param=param) from e

    def echo_logprobs(self, ids: list[int], top: int) -> dict:
        """The legacy logprobs object of the prompt itself (echo): its first token has none.
        Scored in its own forward, off the engine's thread (`jaxinfer.scoring`)."""
        tok = self._tokenizer("logprobs")
        lp = score_tokens(self.loop.engine.model, ids)
        alts = [list(zip(i.tolist(), v.tolist()))[:top] for i, v in zip(lp.top_ids, lp.top_logprobs)]
        obj, _ = completion_logprobs(tok, ids, [None] + lp.logprob.tolist(), [None] + alts)
        return obj

    async def prompt_logprobs(self, body: _Common, ids: list[int]) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` of one prompt, if the body asks (scored off the engine's thread)."""
        if body.prompt_logprobs is None:
            return None
        tok = self._tokenizer("prompt_logprobs")
        scored = await asyncio.to_thread(score_tokens, self.loop.engine.model, ids)
        return vllm_prompt_logprobs(tok, ids, scored, body.prompt_logprobs)

    def _tokenizer(self, param: str):
        if self.tokenizer is None:
            raise ErrorBody(400, f"{param}: this model has no tokenizer; send token ids", param=param)
        return self.tokenizer

    def _check_length(self, ids: list[int], param: str, generating: bool = True) -> list[int]:
        """A prompt fits the context with room for one generated token (or, scored only, fills it)."""
        if not ids:
            raise ErrorBody(400, f"{param} is empty", param=param)
        if len(ids) > (self.max_model_len - 1 if generating else self.max_model_len):
            room = " (prompt + at least one generated token)" if generating else ""
            raise ErrorBody(400, f"{param} has {len(ids)} tokens; the context is {self.max_model_len} tokens{room}",
                            param=param, code="context_length_exceeded")
        return ids

    def params(self, body: _Common, ids: list[int], default_max_tokens: int | None):
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise ErrorBody(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if getattr(body, "suffix", None):
            raise ErrorBody(400, "suffix is not supported: this server does not fill in the middle", param="suffix")
        if getattr(body, "use_beam_search", False):
            raise ErrorBody(400, "use_beam_search is not supported: this server samples (ask for n choices and pick)",
                            param="use_beam_search")
        if (getattr(body, "best_of", None) or 1) > 1:
            raise ErrorBody(400, "best_of > 1 is not supported: ask for n choices (with logprobs) and pick",
                            param="best_of")
        if body.num_logprobs is not None:
            self._tokenizer("logprobs")  # token strings need it
        if body.stream_options is not None and not body.stream:
            raise ErrorBody(400, "stream_options is only allowed with stream: true", param="stream_options")
        if body.prompt_logprobs is not None and body.stream:  # as vLLM
            raise ErrorBody(400, "prompt_logprobs are not available with stream: true", param="prompt_logprobs")
        if body.max_tokens == 0 and not getattr(body, "echo", False):
            with_echo = " (0 only with echo: the prompt scored, nothing generated)" if isinstance(body, CompletionRequest) else ""
            raise ErrorBody(400, f"max_tokens must be at least 1{with_echo}", param="max_tokens")
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            # OpenAI's successor of the deprecated max_tokens: it wins when both are sent (as in vLLM)
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        if body.max_tokens == 0:
            return []  # echo only: no choice is generated
        if body.max_tokens is not None and len(ids) + body.max_tokens > self.max_model_len:
            # the engine would cut the request at the context's end; OpenAI and vLLM's server refuse it
            raise ErrorBody(400, f"max_tokens={body.max_tokens} does not fit: the prompt has {len(ids)} tokens and "
                                 f"the context (max_model_len) is {self.max_model_len}", param="max_tokens",
                            code="context_length_exceeded")
        try:
            # the default (completions: 16, OpenAI's) never asks for more than the context has left
            return body.sampling_params(min(default_max_tokens or self.max_model_len, self.max_model_len - len(ids)),
                                        self.sampling_defaults)
        except ValueError as e:
            raise ErrorBody(400, str(e), param=_field_of(str(e))) from e

    # ---- running a request ----------------------------------------------------------------------

    async def submit(self, prompts: list[list[int]], params, salt: str | None) -> tuple[Sink, list[str]]:
        """Start choice i as `prompts[i]` sampled with `params[i]` (all or none)."""
        if len(prompts) > self.loop.max_outstanding:  # more than the server ever holds: no retry helps
            raise ErrorBody(400, f"n={len(prompts)} choices; this server holds at most {self.loop.max_outstanding} "
                                 "requests (max_slots + max_queue)", param="n")
        for structured in {p.structured_outputs for p in params if p.structured_outputs is not None}:
            try:  # compiled here, off the engine's thread (a deep schema takes seconds): no other stream stalls
                await asyncio.to_thread(self.loop.engine.compile_grammar, structured)
            except ValueError as e:
                raise ErrorBody(400, str(e), param=_field_of(str(e))) from e
        sink = Sink(asyncio.get_running_loop())
        try:
            rids = self.loop.submit(prompts, params, salt, sink)
        except QueueFull as e:
            self.loop.stats.reject("queue_full")
            raise ErrorBody(429, f"server busy: {e}; retry later", code="queue_full", err_type="rate_limit_error",
                            headers={"Retry-After": "1"}) from e
        event = await sink.get()
        if event[0] == "invalid":
            message = str(event[1])
            param = ("max_tokens" if message.startswith("prompt of") else
                     "prompt" if message.startswith("prompt") else _field_of(message))
            too_long = "max_model_len" in message or "more pages than a request can hold" in message
            raise ErrorBody(400, message, param=param, code="context_length_exceeded" if too_long else None)
        if event[0] == "failed":
            raise engine_failure(event[2])
        return sink, rids

    async def events(self, raw: Request, sink: Sink, rids: list[str]) -> AsyncIterator[tuple]:
        """Yield ("output", index, RequestOutput) until every choice has finished; raise
        ErrorBody if the engine fails a choice or the server stops it. Aborts the remaining
        choices if the client goes away (or the consumer stops early, or a choice failed)."""
        left = len(rids)
        clock = asyncio.get_running_loop().time
        next_check = clock() + DISCONNECT_POLL_S  # checked on this clock, not only when no event comes
        try:
            while left:
                try:
                    event = await asyncio.wait_for(sink.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
                if clock() >= next_check:
                    if await raw.is_disconnected():
                        return
                    next_check = clock() + DISCONNECT_POLL_S
                if event is None:
                    continue
                if event[0] == "failed":
                    raise engine_failure(event[2])
                if event[0] == "aborted":  # only the server aborts a request whose client is listening
                    raise ErrorBody(503, "the server is shutting down and stopped this request; retry",
                                    code="server_shutdown", err_type="server_error")
                if event[2].finished:
                    left -= 1
                yield event
        finally:
            if left:
                self.loop.abort(rids)


def running_usage(body: _Common) -> Callable[[int, int], dict | None]:
    """vLLM's `stream_options.continuous_usage_stats`: (prompt, generated so far) -> the usage
    every chunk carries; None (the chunk's `usage: null`) without it."""
    continuous = body.include_usage and body.stream_options.continuous_usage_stats
    return lambda prompt, generated: usage(prompt, generated) if continuous else None


def cached_prompt(out) -> int:
    """The prompt tokens the prefix cache spared a finished choice (the usage counts each
    prompt once: its first choice's)."""
    return out.metrics.num_cached_prompt_tokens


def engine_failure(message: str) -> ErrorBody:
    """A request the engine accepted and then could not run (it logged why, with the request id)."""
    return ErrorBody(500, f"the engine stopped this request: {message}", code="engine_error", err_type="server_error")


def internal_error(error: Exception, request_id: str) -> ErrorBody:
    """An exception no handler expected: logged with the request id the client is told."""
    logger.error("request %s failed: %s: %s", request_id, type(error).__name__, error, exc_info=error)
    return ErrorBody(500, f"internal server error (request id {request_id}; the server logged it)",
                     code="internal_error", err_type="server_error")


def check_generation_config(value: str) -> None:
    """`generation_config` is "auto", "vllm" or a directory (vLLM's `--generation-config`)."""
    if value not in ("auto", "vllm") and not Path(value).is_dir():
        raise ValueError(f"generation_config={value!r} must be 'auto', 'vllm' or a directory holding a "
                         "generation_config.json")


def _field_of(message: str) -> str | None:
    """The field a ValueError message names: 'top_p=1.5 must be ...' -> 'top_p'; a tool's by
    its path: 'tools.2.function.parameters: ...' -> that path."""
    m = re.match(r"\s*(tools\.\d+\.function\.[a-z_]+|[A-Za-z_]+)(\.[A-Za-z_]+)?\s*(=|:| must| is)", message)
    return m.group(1) if m else None


# ---- endpoints ----------------------------------------------------------------------------------


async def completions(server: OpenAIServer, raw: Request, body: CompletionRequest):
    model = server.check_model(body)
    prompts = server.completion_prompts(body)
    # per prompt: a default max_tokens never asks for more than that prompt's context has left
    per_prompt = [server.params(body, ids, default_max_tokens=16) for _, ids in prompts]
    params = per_prompt[0]
    n, wants_logprobs = body.n, body.num_logprobs is not None
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    # echo: each choice's text starts with its prompt (the text as sent, or the ids decoded,
    # special tokens included, as the echoed logprobs list them); choice i answers prompt
    # i // n, as OpenAI numbers the choices of a batch
    echoed = [("" if not body.echo else text if text is not None else
               server.tokenizer.decode(ids, skip_special_tokens=False) if server.tokenizer else "")
              for text, ids in prompts]
    echo_lps = [None] * len(prompts)
    if body.echo and wants_logprobs:
        echo_lps = [await asyncio.to_thread(server.echo_logprobs, ids, body.num_logprobs) for _, ids in prompts]
    prompt_lps = [await server.prompt_logprobs(body, ids) for _, ids in prompts]
    if not params:  # max_tokens 0 with echo: the prompts (and their logprobs), nothing generated
        return _echo_only(body, model, echoed, echo_lps, prompt_lps, prompt_tokens)
    sink, rids = await server.submit([ids for _, ids in prompts for _ in range(n)], [p for ps in per_prompt for p in ps],
                                     body.salt)
    rid, created = new_id("cmpl"), now()

    def chunk(choices, use=None):
        d = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if body.include_usage:
            d["usage"] = use
        return d

    running = running_usage(body)

    def logprobs(out, offset=0, new_only=True):
        if not wants_logprobs:
            return None, offset
        return completion_logprobs(server.tokenizer, *tokens_of(out, new_only), offset)

    if body.stream:
        async def stream():
            # the generated text's offsets follow the prompt's
            generated, offsets, cached = 0, [len(echoed[i // n]) for i in range(len(rids))], 0
            if body.echo:
                for i in range(len(rids)):
                    yield _sse(chunk([{"index": i, "text": echoed[i // n], "logprobs": echo_lps[i // n],
                                       "finish_reason": None}], running(prompt_tokens, 0)))
            async for _, index, out in server.events(raw, sink, rids):
                generated += len(out.delta_token_ids)
                cached += cached_prompt(out) if out.finished and index % n == 0 else 0
                if out.delta_text or out.finished or (wants_logprobs and out.delta_token_ids):
                    lp, offsets[index] = logprobs(out, offsets[index])
                    yield _sse(chunk([{"index": index, "text": out.delta_text, "logprobs": lp,
                                       "finish_reason": out.finish_reason if out.finished else None,
                                       "stop_reason": out.stop_reason}], running(prompt_tokens, generated)))
            if body.include_usage:
                yield _sse(chunk([], usage(prompt_tokens, generated, cached)))
            yield DONE
        return StreamingResponse(_guarded(stream(), raw), media_type="text/event-stream")

    finals = await _collect(server, raw, sink, rids)
    choices = [{"index": i, "text": echoed[i // n] + o.text, "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason, "logprobs": join_logprobs(echo_lps[i // n], logprobs(o, len(echoed[i // n]), new_only=False)[0])}
               | ({} if prompt_lps[i // n] is None else {"prompt_logprobs": prompt_lps[i // n]})
               for i, o in finals]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, sum(len(o.token_ids) for _, o in finals),
                                               sum(cached_prompt(o) for i, o in finals if i % n == 0))}


def _echo_only(body: CompletionRequest, model: str, echoed: list[str], echo_lps: list[dict | None],
               prompt_lps: list[list | None], prompt_tokens: int):
    """`max_tokens: 0` with `echo`: the prompts scored, nothing generated (how evaluation
    harnesses ask for a text's loglikelihood)."""
    choices = [{"index": i, "text": echoed[i // body.n], "logprobs": echo_lps[i // body.n], "finish_reason": "length",
                "stop_reason": None}
               | ({} if prompt_lps[i // body.n] is None else {"prompt_logprobs": prompt_lps[i // body.n]})
               for i in range(len(echoed) * body.n)]
    d = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": model}
    if not body.stream:
        return d | {"choices": choices, "usage": usage(prompt_tokens, 0, 0)}

    async def stream():
        yield _sse(d | {"choices": choices} | ({"usage": None} if body.include_usage else {}))
        if body.include_usage:
            yield _sse(d | {"choices": [], "usage": usage(prompt_tokens, 0, 0)})
        yield DONE
    return StreamingResponse(stream(), media_type="text/event-stream")


async def chat_completions(server: OpenAIServer, raw: Request, body: ChatCompletionRequest,
                           accepted: asyncio.Event | None = None):
    """`accepted` is set once the engine has taken the request (every check passed)."""
    model = server.check_model(body)
    ids = server.chat_ids(body)
    params = server.params(body, ids, default_max_tokens=None)
    # "auto" with a parser: the model may write calls in its text (`TextCalls`), whose tags
    # some tokenizers make special tokens: kept in the text (as vLLM's parsers do)
    parsed = bool(body.tools) and body.effective_tool_choice == "auto" and server.tool_call_parser is not None
    one_call = body.parallel_tool_calls is False  # calls read from the text: the first kept (vLLM's rule)
    if parsed:
        params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    if body.calls_tools:  # a forced call ends where its grammar does: a stop string would cut its JSON
        params = [dataclasses.replace(p, stop=()) for p in params]
    prompt_lps = await server.prompt_logprobs(body, ids)
    sink, rids = await server.submit([ids] * len(params), params, body.salt)
    if accepted is not None:
        accepted.set()
    rid, created = new_id("chatcmpl"), now()

    def chunk(choices, use=None):
        d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
        if body.include_usage:
            d["usage"] = use
        return d

    running = running_usage(body)

    def logprobs(out, new_only=True):
        return chat_logprobs(server.tokenizer, *tokens_of(out, new_only)) if body.logprobs else None

    choice = body.effective_tool_choice if body.calls_tools else None  # the answer is a constrained call
    required = choice == "required"  # a JSON array of calls, each streamed as it is written
    named = None if choice is None or required else choice.function.name  # its arguments, streamed as they come
    reasoner = server.reasoning_parser  # the model may think first, even before a constrained answer

    def used(outs: list[list[int]], cached: int) -> dict:
        """The usage of answers of these tokens (with their `reasoning_tokens`, given a parser)."""
        use = usage(len(ids), sum(map(len, outs)), cached)
        if reasoner is None:
            return use
        counts = [reasoner.count(o, server.tokenizer) for o in outs]
        return use | {"completion_tokens_details": {"reasoning_tokens": sum(counts)}}

    def thought(reasoning: str | None) -> dict:
        """The message's (or a delta's) reasoning fields, under vLLM's old and new names."""
        if reasoner is None or not body.include_reasoning or (reasoning is None and body.stream):
            return {}
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def finish(out, called: bool) -> str:
        """An answer that ended by itself with calls read from it finishes with them."""
        return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason

    if body.stream:
        async def stream():
            for i in range(len(rids)):
                yield _sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}], running(len(ids), 0)))
            generated, started, answers, cached = 0, [False] * len(rids), [[] for _ in rids], 0
            # per choice, what reads calls in its text: "required" calls as they are written
            # (`RequiredCalls`), "auto" with a parser the calls among the content (`TextCalls`)
            readers = [RequiredCalls() if required else server.tool_call_parser() if parsed else None for _ in rids]
            thinkers = [reasoner.stream() if reasoner else None for _ in rids]
            async for _, index, out in server.events(raw, sink, rids):
                generated += len(out.delta_token_ids)
                answers[index] += out.delta_token_ids
                cached = cached_prompt(out) if out.finished and index == 0 else cached
                text, with_logprobs, reasoning = out.delta_text, bool(body.logprobs and out.delta_token_ids), None
                if thinkers[index] is not None:
                    reasoning, text = thinkers[index].feed(text)
                    if out.finished:
                        rest = thinkers[index].finish()
                        reasoning, text = reasoning + rest[0], text + rest[1]
                if required:
                    deltas = readers[index].feed(text)
                    delta = {"tool_calls": deltas} if deltas else {}
                elif parsed:
                    content, calls = readers[index].stream(text, out.finished)
                    calls = [c for c in calls if c["index"] == 0] if one_call else calls
                    delta = ({"content": content} if content or with_logprobs else {}) | (
                        {"tool_calls": calls} if calls else {})
                elif named is not None:  # the call's id and name first, then its arguments
                    delta = {}
                    if text or not started[index]:
                        delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}} if started[index] else
                                                tool_call(named, text, index=0)]}
                        started[index] = True
                else:
                    delta = {"content": text} if text or with_logprobs else {}
                delta = thought(reasoning or None) | delta
                if delta or with_logprobs:
                    yield _sse(chunk([{"index": index, "delta": delta, "logprobs": logprobs(out), "finish_reason": None}],
                                     running(len(ids), generated)))
                if out.finished:
                    called = readers[index].closed if required else parsed and readers[index].calls > 0
                    yield _sse(chunk([{"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": finish(out, called), "stop_reason": out.stop_reason}],
                                     running(len(ids), generated)))
            if body.include_usage:
                yield _sse(chunk([], used(answers, cached)))
            yield DONE
        return StreamingResponse(_guarded(stream(), raw), media_type="text/event-stream")

    def message(out) -> tuple[dict, list | None]:
        reasoning, text = reasoner.split(out.text) if reasoner else (None, out.text)
        if parsed:
            content, calls = server.tool_call_parser.parse(text or "")
            calls = calls[:1] if one_call else calls
            return {"role": "assistant", "content": content} | thought(reasoning) | ({"tool_calls": calls} if calls else {}), calls
        if choice is None:
            return {"role": "assistant", "content": text if reasoner is None else text or None} | thought(reasoning), None
        calls = parse_calls(text or "", choice)  # cut short: as far as written, as streamed
        return {"role": "assistant", "content": None} | thought(reasoning) | ({"tool_calls": calls} if calls else {}), calls

    finals = await _collect(server, raw, sink, rids)
    choices = []
    for i, o in finals:
        msg, calls = message(o)
        choices.append({"index": i, "message": msg, "logprobs": logprobs(o, new_only=False),
                        "finish_reason": finish(o, (required or parsed) and bool(calls)), "stop_reason": o.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": used([list(o.token_ids) for _, o in finals],
                                              cached_prompt(finals[0][1]) if finals else 0)} | (
        {} if prompt_lps is None else {"prompt_logprobs": prompt_lps})


async def responses(server: OpenAIServer, raw: Request, body: ResponsesRequest):
    """OpenAI's Responses API, answered by the chat endpoint (`jaxinfer.server.responses`)."""
    history = []
    if body.previous_response_id is not None:
        earlier = server.responses.get(body.previous_response_id, param="previous_response_id")
        if earlier.response["status"] in ("queued", "in_progress"):
            raise ErrorBody(400, f"previous_response_id: response {body.previous_response_id!r} is still "
                                 f"{earlier.response['status']}; continue it once it has finished",
                            param="previous_response_id")
        history = earlier.conversation()
    chat = body.to_chat(history)
    if body.background:
        return await _in_background(server, body, chat, history)
    events = ResponseEvents(body, server.check_model(chat))
    if body.store:  # retrievable as "in_progress" from the start, as OpenAI's stored responses are
        server.responses.put(events.snapshot(ended=False), history + body.input_items())
    try:
        answer = await chat_completions(server, raw, chat)
    except ErrorBody as e:  # in the response request's names
        server.responses.discard(events.id)
        raise renamed(e) from None
    except BaseException:
        server.responses.discard(events.id)
        raise
    if not body.stream:
        # no choice: the client left and its request was aborted
        response = to_response(body, answer, events.id) if answer["choices"] else events.snapshot()
        if body.store:
            server.responses.finish(events.id, response)
        return response

    async def stream():
        try:
            async for event in events.translate(answer.body_iterator):
                yield event
        finally:  # also when the client leaves mid-stream: kept as far as it got, "cancelled"
            if body.store:
                server.responses.finish(events.id, events.snapshot())

    return StreamingResponse(_guarded(stream(), raw), media_type="text/event-stream")


@dataclasses.dataclass(frozen=True)
class _Detached:
    """The `Request` of a background response: no client listens; it "leaves" once the
    response is cancelled or deleted, so the engine's requests are aborted."""

    wanted: Callable[[], bool]

    async def is_disconnected(self) -> bool:
        return not self.wanted()


async def _in_background(server: OpenAIServer, body: ResponsesRequest, chat: ChatCompletionRequest,
                         history: list[dict]) -> dict:
    """OpenAI's background mode: checked and started like any request (a bad one is a 400 now),
    then answered at once with status "queued" while the engine generates; the stored
    response becomes "in_progress", then the answer ("completed" / "incomplete") or "failed"."""
    if not body.store:
        raise ErrorBody(400, "background: true needs store: true (the answer is fetched from the store later)",
                        param="background")
    if body.stream:
        raise ErrorBody(400, "background: true with stream: true is not supported; poll GET /v1/responses/{id}",
                        param="stream")
    queued = response_object(responses_id("resp"), now(), server.check_model(chat), body, [], None, None)
    response_id, accepted = queued["id"], asyncio.Event()

    async def generate() -> None:
        try:
            answer = await chat_completions(server, _Detached(lambda: server.responses.wanted(response_id)), chat,
                                            accepted)
            final = to_response(body, answer, response_id) | {"created_at": queued["created_at"]}
        except Exception as e:
            if not accepted.is_set():
                raise  # refused up front: the POST answers it
            code = (e.code or e.err_type) if isinstance(e, ErrorBody) else "server_error"
            final = queued | {"status": "failed", "error": {"code": code, "message": str(e)}}
        server.responses.finish(response_id, final)

    server.responses.put(queued | {"status": "in_progress"}, history + body.input_items())
    task = server.responses.generate(generate())
    started = asyncio.create_task(accepted.wait())
    await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    started.cancel()
    if task.done() and not accepted.is_set():
        server.responses.delete(response_id)
        error = task.exception()
        raise renamed(error) if isinstance(error, ErrorBody) else error
    return queued | {"status": "queued"}


async def _collect(server: OpenAIServer, raw: Request, sink: Sink, rids: list[str]):
    """The final output of every choice, in index order (empty if the client left)."""
    finals = {}
    async for _, index, out in server.events(raw, sink, rids):
        if out.finished:
            finals[index] = out
    return sorted(finals.items())


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _guarded(events: AsyncIterator[str], raw: Request) -> AsyncIterator[str]:
    """The SSE lines of a stream; an error after the response started (status 200 is sent)
    becomes an SSE event holding the OpenAI error object, then `[DONE]`, not a cut connection."""
    try:
        async for line in events:
            yield line
    except Exception as e:
        error = e if isinstance(e, ErrorBody) else internal_error(e, raw.state.request_id)
        yield f"data: {_json(error.body())}\n\n"
        yield DONE


def _json(data) -> str:
    """JSON with non-ASCII escaped: input echoed in an error may hold a lone surrogate, which
    UTF-8 cannot encode but a \\u escape can."""
    return json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


class ErrorResponse(JSONResponse):
    """An OpenAI error object, ASCII-escaped (`_json`)."""

    def render(self, content) -> bytes:
        return _json(content).encode("ascii")


# ---- the app ------------------------------------------------------------------------------------


def create_app(server: OpenAIServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    _add_error_handlers(app)
    if server.api_key:
        app.add_middleware(ApiKeyAuth, api_key=server.api_key)
    # outside the key check: a browser's preflight (OPTIONS) carries no key; vLLM's defaults
    app.add_middleware(CORSMiddleware, allow_origins=server.allowed_origins, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestIds)  # added last: outermost, so it also sees what the others do

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        engine = server.loop.engine
        if not engine.ready:  # read-only peek at the engine thread's state: a momentary answer
            return JSONResponse({"status": "warming up", "detail": "compiling the engine's programs"},
                                status_code=503, headers={"Retry-After": str(WARMING_RETRY_AFTER_S)})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.loop.stats.render(server.loop.snapshot, server.loop.outstanding),
                                 media_type="text/plain; version=0.0.4")

    created = now()  # the models are loaded by the time the app is made

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "jaxinfer",
                "max_model_len": server.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(name) for name in server.model_names]}

    @app.get("/v1/models/{name:path}")  # OpenAI's retrieve (`client.models.retrieve`); names may hold "/"
    async def model(name: str):
        if name not in server.model_names:
            raise ErrorBody(404, f"model {name!r} does not exist", param="model", code="model_not_found")
        return card(name)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def post_tokenize(body: TokenizeRequest):
        return server.tokenize(body)

    @app.post("/detokenize")
    async def post_detokenize(body: DetokenizeRequest):
        return server.detokenize(body)

    @app.post("/v1/completions")
    async def post_completions(body: CompletionRequest, raw: Request):
        return await completions(server, raw, body)

    @app.post("/v1/chat/completions")
    async def post_chat(body: ChatCompletionRequest, raw: Request):
        return await chat_completions(server, raw, body)

    @app.post("/v1/responses")
    async def post_responses(body: ResponsesRequest, raw: Request):
        return await responses(server, raw, body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False):
        if stream:  # OpenAI resumes a background response's events here; background is not streamed here
            raise ErrorBody(400, "stream: retrieving a response as a stream of events is not supported; "
                                 "GET it without stream", param="stream")
        return server.responses.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return server.responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return server.responses.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None):
        return server.responses.input_items(response_id, limit, order, after)

    return app


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           err_type: str = "invalid_request_error", headers=None) -> ErrorResponse:
    return _response(ErrorBody(status, message, param, code, err_type, headers))


def _response(e: ErrorBody) -> ErrorResponse:
    return ErrorResponse(e.body(), status_code=e.status, headers=e.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ErrorBody)
    async def on_error(_, e: ErrorBody):
        return _response(e)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError):
        kind = request.headers.get("content-type", "")
        if request.method == "POST" and not kind.split(";")[0].strip().lower().endswith("json"):
            return _error(400, f"send the body as JSON with 'Content-Type: application/json' (got {kind or 'none'!r})",
                          code="invalid_content_type")
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _union_member(p)) or None
        if first.get("type") == "json_invalid" or param is None:
            return _error(400, f"the body must be a JSON object: {first.get('msg')}", code="invalid_json")
        return _error(400, f"{param or 'body'}: {first.get('msg')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_, e: StarletteHTTPException):
        if e.status_code == 400 and e.detail == "There was an error parsing the body":  # FastAPI's, e.g. bad UTF-8
            return _error(400, "the body must be a JSON object in UTF-8: it could not be decoded", code="invalid_json")
        return _error(e.status_code, str(e.detail), err_type="invalid_request_error" if e.status_code < 500 else "server_error")


def _union_member(part: str | int) -> bool:
    """Whether a part of pydantic's error location names which member of a union type failed
    (`str`, `list[int]`, `ContentPart`, ...) rather than a field: not a part of the param."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none")
                                      or "[" in part or part[:1].isupper())


# ---- middleware (pure ASGI: `@app.middleware("http")` would wrap `receive`, and handlers
# would never see their client disconnect, so requests of clients that left would run on) ----


class ApiKeyAuth:
    """Every path but `OPEN_PATHS` needs `Authorization: Bearer <api_key>` (else 401): the API,
    `/tokenize` and `/detokenize` (work for the server), `/version`, the OpenAPI docs."""

    OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS and not self._authorized(scope):
            response = _error(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key", err_type="authentication_error")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)  # constant time: no key guessing by timing


class RequestIds:
    """Gives each HTTP request an id (`request.state.request_id`, the `x-request-id` header)
    and answers an exception no handler took with a logged OpenAI-shaped 500 naming that id,
    instead of uvicorn's plain-text 500 and a closed connection."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = new_id("req")
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            error = internal_error(e, request_id)
            if not started:  # else the response is under way: nothing can be said any more
                await _response(error)(scope, receive, send_with_id)
