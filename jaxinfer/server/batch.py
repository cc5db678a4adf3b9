"""OpenAI's batch file format, served offline (`jaxinfer run-batch`, vLLM's `run-batch`).

Each input line is one request,

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

(`url`: /v1/chat/completions, /v1/completions or /v1/responses), and each output line its answer,
in input order:

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}

A request the server refuses keeps its status and error body in `response`, as OpenAI's batch
output does; a line that is not a request (bad JSON, another method or url, `stream: true`) gets
`response: null` and an `error` naming the problem. The requests go through the same app as
`jaxinfer serve` (`create_app`), called in-process over ASGI, all at once up to what the server
holds (`max_slots + max_queue`), so the engine batches them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

from jaxinfer.server.app import OpenAIServer, create_app
from jaxinfer.server.protocol import new_id

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def run_batch(server: OpenAIServer, lines: Iterable[str]) -> list[dict[str, Any]]:
    """The output records of the input `lines` (blank lines skipped), in order."""
    return asyncio.run(_run(server, [(n, line) for n, line in enumerate(lines, 1) if line.strip()]))


async def _run(server: OpenAIServer, lines: list[tuple[int, str]]) -> list[dict[str, Any]]:
    app = create_app(server)
    room = asyncio.Semaphore(server.loop.max_outstanding)
    server.loop.start()  # what the app's lifespan would do under uvicorn
    try:
        async def one(line_number: int, line: str) -> dict[str, Any]:
            def invalid(custom_id: Any, message: str) -> dict[str, Any]:
                custom_id = custom_id if isinstance(custom_id, str) else None
                return _record(custom_id, None, {"code": "invalid_request", "line": line_number, "message": message})

            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                return invalid(None, f"not JSON: {e}")
            custom_id = item.get("custom_id") if isinstance(item, dict) else None
            try:
                url, body = _request(item)
            except ValueError as e:
                return invalid(custom_id, str(e))
            async with room:
                status, headers, answer = await _post(app, url, json.dumps(body).encode())
                while status == 429:  # the server is full (requests of n choices hold several places)
                    await asyncio.sleep(0.1)
                    status, headers, answer = await _post(app, url, json.dumps(body).encode())
            response = {"status_code": status, "request_id": headers.get("x-request-id", ""), "body": answer}
            return _record(custom_id, response, None)

        return list(await asyncio.gather(*(one(n, line) for n, line in lines)))
    finally:
        await asyncio.to_thread(server.loop.stop)


def _request(item: Any) -> tuple[str, dict[str, Any]]:
    """(url, body) of a parsed input line; ValueError naming what is wrong."""
    if not isinstance(item, dict):
        raise ValueError("a request line is a JSON object")
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if method != "POST":
        raise ValueError(f"method={method!r}: batch requests are POST")
    if url not in URLS:
        raise ValueError(f"url={url!r} must be one of {', '.join(URLS)}")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object (the request)")
    if body.get("stream"):
        raise ValueError("body.stream: a batch answers whole responses, not streams")
    return url, body


def _record(custom_id: str | None, response: dict[str, Any] | None, error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": new_id("batch_req", "_"), "custom_id": custom_id, "response": response, "error": error}


async def _post(app, path: str, body: bytes) -> tuple[int, dict[str, str], Any]:
    """POST `body` to `path` of the ASGI `app`: (status, headers, the JSON answer)."""
    started, chunks, done = {}, [], asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client stays until its answer is complete (a disconnect would abort it)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            started.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("run-batch", 0)}
    await app(scope, receive, send)
    headers = {k.decode().lower(): v.decode() for k, v in started.get("headers", [])}
    return started["status"], headers, json.loads(b"".join(chunks) or b"null")
