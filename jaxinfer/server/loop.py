"""`EngineLoop`: one background thread owns the engine; HTTP handlers talk to it by messages.

    handler (event loop)                     engine thread
    submit(prompts, params, sink) --cmd-->   add_request x n (all or none)
                         <-- sink.put --     ("accepted", ids) | ("error", ValueError)
                         <-- sink.put --     ("output", index, RequestOutput) after each step
    abort(ids)           --cmd-->            engine.abort (pages return to the pool)

Only the engine thread touches the `Engine`; handlers read `snapshot` (the engine metrics
after the latest step). The number of outstanding requests is bounded: `submit` raises
`QueueFull` instead of queueing more, so memory never grows without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Sequence

from jaxinfer.engine import Engine, EngineMetrics, RequestOutput
from jaxinfer.sampling import SamplingParams
from jaxinfer.server.metrics import ServerMetrics


class QueueFull(Exception):
    """More requests are outstanding than the server admits; retry later."""


class Sink:
    """Where the engine thread posts one HTTP request's events (thread-safe, non-blocking)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass

    async def get(self) -> tuple:
        return await self.queue.get()


@dataclasses.dataclass(frozen=True)
class _Add:
    ids: tuple[str, ...]
    prompt: list[int]
    params: tuple[SamplingParams, ...]
    cache_salt: str | None
    sink: Sink


@dataclasses.dataclass
class _Live:
    """A request the engine thread is serving: where its events go and its token timing."""

    sink: Sink
    index: int
    last_token_time: float | None = None


class EngineLoop:
    def __init__(self, engine: Engine, max_outstanding: int):
        if max_outstanding < 1:
            raise ValueError(f"{max_outstanding=} must be >= 1")
        self.engine = engine
        self.max_outstanding = max_outstanding
        self.stats = ServerMetrics()
        self.snapshot: EngineMetrics = engine.metrics()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._lock = threading.Lock()
        self._outstanding = 0
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine-loop", daemon=True)

    # ---- called from the event loop ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and join the thread."""
        self._stopping.set()
        self._cmds.put(None)
        self._thread.join(timeout)

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def submit(self, prompt: list[int], params: Sequence[SamplingParams], cache_salt: str | None, sink: Sink) -> list[str]:
        """Queue one request per `params` (the n choices of one prompt); raises QueueFull.
        The sink then receives ("accepted", ids) or ("error", ValueError) first."""
        n = len(params)
        with self._lock:
            if self._stopping.is_set() or self._outstanding + n > self.max_outstanding:
                raise QueueFull(f"{self._outstanding} requests outstanding (limit {self.max_outstanding})")
            self._outstanding += n
        base = f"srv-{next(self._ids)}"
        ids = tuple(f"{base}-{i}" for i in range(n))
        self._cmds.put(_Add(ids, prompt, tuple(params), cache_salt, sink))
        return list(ids)

    def abort(self, ids: Sequence[str]) -> None:
        self._cmds.put(("abort", tuple(ids)))

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain(block=not self.engine.has_unfinished_requests())
            if self._stopping.is_set():
                break
            if self.engine.has_unfinished_requests():
                self._step()
            self.snapshot = self.engine.metrics()
        for rid in list(self._live):
            self._abort(rid)

    def _drain(self, block: bool) -> None:
        """Apply every queued command; with `block`, wait (briefly) for the first one."""
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
            while True:
                if cmd is not None:
                    self._apply(cmd)
                cmd = self._cmds.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        else:
            for rid in cmd[1]:
                self._abort(rid)

    def _add(self, cmd: _Add) -> None:
        added = []
        try:
            for rid, params in zip(cmd.ids, cmd.params):
                self.engine.add_request(cmd.prompt, params, request_id=rid, cache_salt=cmd.cache_salt)
                added.append(rid)
        except ValueError as e:
            for rid in added:
                self.engine.abort(rid)
            self._release(len(cmd.ids))
            self.stats.reject("invalid")
            cmd.sink.put(("error", e))
            return
        for i, rid in enumerate(cmd.ids):
            self._live[rid] = _Live(cmd.sink, i)
        with self.stats.lock:
            self.stats.prompt_tokens += len(cmd.prompt) * len(cmd.ids)
        cmd.sink.put(("accepted", cmd.ids))

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is None:  # already finished (or never added)
            return
        if rid in self.engine.requests:
            self.engine.abort(rid)
        self._release(1)
        with self.stats.lock:
            self.stats.finished["abort"] = self.stats.finished.get("abort", 0) + 1
        live.sink.put(("aborted", live.index))

    def _release(self, n: int) -> None:
        with self._lock:
            self._outstanding -= n

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug in a step: fail every request rather than hang them
            for rid in list(self._live):
                live = self._live[rid]
                self._abort(rid)
                live.sink.put(("error", e))
            return
        now = time.perf_counter()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is not None:
                self._record(live, out, now)
                live.sink.put(("output", live.index, out))
                if out.finished:
                    del self._live[out.request_id]
                    self._release(1)

    def _record(self, live: _Live, out: RequestOutput, now: float) -> None:
        m, s = out.metrics, self.stats
        with s.lock:
            s.generation_tokens += len(out.delta_token_ids)
            if out.delta_token_ids:
                if live.last_token_time is None:
                    s.ttft.observe(m.time_to_first_token)
                else:
                    s.itl.observe((now - live.last_token_time) / len(out.delta_token_ids))
                live.last_token_time = now
            if out.finished:
                s.finished[out.finish_reason] = s.finished.get(out.finish_reason, 0) + 1
                s.e2e.observe(now - m.arrival_time)
