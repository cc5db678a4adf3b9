"""Wiring: model + engine config -> `OpenAIServer` -> uvicorn on a host and port."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from collections.abc import Sequence

import uvicorn

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import Model
from jaxinfer.server.app import OpenAIServer, check_generation_config, create_app
from jaxinfer.server.loop import EngineLoop
from jaxinfer.reasoning import find_reasoning_parser
from jaxinfer.server.tools import call_parser


def build_server(model: Model, engine_config: EngineConfig, model_name: str | Sequence[str],
                 api_key: str | None = None, max_queue: int = 256, warmup: bool = True,
                 tool_call_parser: str | None = None, allowed_origins: Sequence[str] = ("*",),
                 reasoning_parser: str | None = None, generation_config: str = "auto") -> OpenAIServer:
    """An engine behind an `OpenAIServer`. At most `max_slots + max_queue` requests are
    outstanding; more are answered 429. With `warmup` the engine compiles its programs in the
    background (`Engine.start_warmup`): the server answers at once, `/health` says 503
    "warming up" until short requests can be served without compiling, and requests sent
    meanwhile wait for the programs they need. `tool_call_parser` ("hermes", "llama3_json"):
    with tool choice "auto", the calls the model writes in its answer come back as `tool_calls`.
    The programs of requests with penalties, a logit bias or a grammar (structured output, tool
    calls) compile last. `allowed_origins`: the web pages (CORS origins) whose scripts may call
    the API, every one by default (vLLM's default). `reasoning_parser` ("qwen3", "deepseek_r1"):
    a chat answer's thinking comes back as `reasoning_content`, and structured output constrains
    only the answer after it (`jaxinfer.reasoning`; the engine config's, if it names one).
    `generation_config` (vLLM's flag): "auto" takes the sampling defaults of requests that leave
    them out from the model's generation_config.json, "vllm" keeps the API's, a directory reads
    its generation_config.json."""
    if max_queue < 0:
        raise ValueError(f"{max_queue=} must be >= 0")
    call_parser(tool_call_parser)  # refused before the engine is built
    find_reasoning_parser(reasoning_parser)
    check_generation_config(generation_config)
    if None not in (reasoning_parser, engine_config.reasoning_parser) and reasoning_parser != engine_config.reasoning_parser:
        raise ValueError(f"reasoning_parser={reasoning_parser!r} differs from the engine config's "
                         f"{engine_config.reasoning_parser!r}")
    reasoning_parser = reasoning_parser or engine_config.reasoning_parser
    engine = Engine(model, dataclasses.replace(engine_config, reasoning_parser=reasoning_parser))
    if warmup:
        engine.start_warmup(penalized=True, logprobs=True)
    return OpenAIServer(EngineLoop(engine, engine_config.max_slots + max_queue), model_name, api_key, tool_call_parser,
                        allowed_origins, reasoning_parser, generation_config)


FLUSH_S = 5.0  # after the grace period: for the stopped requests' 503s and error events to go out


class DrainingServer(uvicorn.Server):
    """uvicorn serving an `OpenAIServer`, with its graceful shutdown: stop accepting, give the
    requests in flight `grace_s` seconds to finish, then stop the engine loop, which ends each
    request left with a 503 `server_shutdown` (or, streamed, an error event), and give those
    answers `FLUSH_S` to go out before uvicorn cancels what remains."""

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0,
                 log_level: str = "info"):
        super().__init__(uvicorn.Config(create_app(server), host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=grace_s + FLUSH_S))
        self.app_server, self.grace_s = server, grace_s

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        grace_over = loop.call_later(self.grace_s, lambda: loop.create_task(asyncio.to_thread(self.app_server.loop.stop)))
        try:
            await super().shutdown(sockets)
        finally:
            grace_over.cancel()


def serve(server: OpenAIServer, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0,
          log_level: str = "info") -> None:
    """Run until SIGINT/SIGTERM: then stop accepting, give in-flight requests `grace_s`
    seconds to finish, stop the rest (a 503 or an error event; their pages return to the pool)
    and return."""
    print(f"serving {', '.join(map(repr, server.model_names))} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler it found: with
    # the default one the process would die with status -15 after a clean shutdown.
    previous = signal.signal(signal.SIGTERM, _exit_after_drain)
    try:
        DrainingServer(server, host, port, grace_s, log_level).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_after_drain(signum, frame) -> None:
    raise SystemExit(0)
