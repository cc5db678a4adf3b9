"""Wiring: model + engine config -> `OpenAIServer` -> uvicorn on a host and port."""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import Model
from jaxinfer.server.app import OpenAIServer, create_app
from jaxinfer.server.loop import EngineLoop
from jaxinfer.server.reasoning import find_reasoning_parser
from jaxinfer.server.tools import call_parser


def build_server(model: Model, engine_config: EngineConfig, model_name: str | Sequence[str],
                 api_key: str | None = None, max_queue: int = 256, warmup: bool = True,
                 tool_call_parser: str | None = None, allowed_origins: Sequence[str] = ("*",),
                 reasoning_parser: str | None = None) -> OpenAIServer:
    """An engine behind an `OpenAIServer`. At most `max_slots + max_queue` requests are
    outstanding; more are answered 429. With `warmup` the engine compiles its programs in the
    background (`Engine.start_warmup`): the server answers at once, `/health` says 503
    "warming up" until short requests can be served without compiling, and requests sent
    meanwhile wait for the programs they need. `tool_call_parser` ("hermes", "llama3_json"):
    with tool choice "auto", the calls the model writes in its answer come back as `tool_calls`.
    The programs of requests with penalties, a logit bias or a grammar (structured output, tool
    calls) compile last. `allowed_origins`: the web pages (CORS origins) whose scripts may call
    the API, every one by default (vLLM's default). `reasoning_parser` ("qwen3", "deepseek_r1"):
    a chat answer's thinking comes back as `reasoning_content` (`jaxinfer.server.reasoning`)."""
    if max_queue < 0:
        raise ValueError(f"{max_queue=} must be >= 0")
    call_parser(tool_call_parser)  # refused before the engine is built
    find_reasoning_parser(reasoning_parser)
    engine = Engine(model, engine_config)
    if warmup:
        engine.start_warmup(penalized=True, logprobs=True)
    return OpenAIServer(EngineLoop(engine, engine_config.max_slots + max_queue), model_name, api_key, tool_call_parser,
                        allowed_origins, reasoning_parser)


def serve(server: OpenAIServer, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0,
          log_level: str = "info") -> None:
    """Run until SIGINT/SIGTERM: then stop accepting, give in-flight requests `grace_s`
    seconds to finish, abort the rest (their pages return to the pool) and return."""
    import uvicorn

    config = uvicorn.Config(create_app(server), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=grace_s)
    print(f"serving {', '.join(map(repr, server.model_names))} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler it found: with
    # the default one the process would die with status -15 after a clean shutdown.
    previous = signal.signal(signal.SIGTERM, _exit_after_drain)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_after_drain(signum, frame) -> None:
    raise SystemExit(0)
