"""`EngineLoop`: one background thread owns the engine; HTTP handlers talk to it by messages.

    handler (event loop)                     engine thread
    submit(prompts, params, sink) --cmd-->   add_request x n (all or none)
                         <-- sink.put --     ("accepted", ids) | ("invalid", ValueError) | ("failed", None, message)
                         <-- sink.put --     ("output", index, RequestOutput) after each step
                         <-- sink.put --     ("failed", index, message): the engine stopped choice `index`
                         <-- sink.put --     ("aborted", index): the server stopped it (shutdown)
    abort(ids)           --cmd-->            engine.abort (pages return to the pool)

Whatever goes wrong on the engine thread is reported to the requests it concerns (and
logged); the thread itself never dies, so no handler waits forever.

Only the engine thread touches the `Engine`; handlers read `snapshot` (the engine metrics
after the latest step). The number of outstanding requests is bounded: `submit` raises
`QueueFull` instead of queueing more, so memory never grows without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence

from jaxinfer.engine import Engine, EngineMetrics, RequestOutput
from jaxinfer.sampling import SamplingParams
from jaxinfer.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

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
    prompts: tuple[list[int], ...]  # choice i's prompt (a batch of prompts, n choices each)
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

    def submit(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], cache_salt: str | None,
               sink: Sink) -> list[str]:
        """Queue one request per (prompt, params) pair (the choices of one HTTP request: n per
        prompt of a batch), all or none; raises QueueFull. The sink then receives
        ("accepted", ids) or ("invalid", ValueError) first; later events carry the choice's index."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts for {len(params)} sampling params")
        n = len(params)
        with self._lock:
            if self._stopping.is_set() or self._outstanding + n > self.max_outstanding:
                raise QueueFull(f"{self._outstanding} requests outstanding (limit {self.max_outstanding})")
            self._outstanding += n
        base = f"srv-{next(self._ids)}"
        ids = tuple(f"{base}-{i}" for i in range(n))
        self._cmds.put(_Add(ids, tuple(prompts), tuple(params), cache_salt, sink))
        return list(ids)

    def abort(self, ids: Sequence[str]) -> None:
        self._cmds.put(("abort", tuple(ids)))

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self.snapshot = self.engine.metrics()
            except Exception as e:  # a bug outside the engine's own containment: fail, never hang
                self._fail_all(e)
        for rid in list(self._live):
            self._abort(rid)
        self.engine.close()  # other processes following this engine stop too

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
            for rid, prompt, params in zip(cmd.ids, cmd.prompts, cmd.params):
                self.engine.add_request(prompt, params, request_id=rid, cache_salt=cmd.cache_salt)
                added.append(rid)
        except Exception as e:
            for rid in added:
                self.engine.abort(rid)
            self._release(len(cmd.ids))
            if isinstance(e, ValueError):  # the engine's verdict on the input
                self.stats.reject("invalid")
                cmd.sink.put(("invalid", e))
            else:
                logger.error("request %s: adding it to the engine failed", cmd.ids[0], exc_info=e)
                self.stats.reject("error")
                cmd.sink.put(("failed", None, f"{type(e).__name__}: {e}"))
            return
        for i, rid in enumerate(cmd.ids):
            self._live[rid] = _Live(cmd.sink, i)
        with self.stats.lock:
            self.stats.prompt_tokens += sum(map(len, cmd.prompts))
        cmd.sink.put(("accepted", cmd.ids))

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is None:  # already finished (or never added)
            return
        self.engine.abort(rid)
        self._release(1)
        self._count_finished("abort")
        live.sink.put(("aborted", live.index))

    def _release(self, n: int) -> None:
        with self._lock:
            self._outstanding -= n

    def _fail_all(self, error: Exception) -> None:
        """Fail every live request with `error` (their clients see it), freeing their pages."""
        logger.error("engine loop failed; failing requests %s", sorted(self._live), exc_info=error)
        for rid in list(self._live):
            live = self._live.pop(rid)
            self.engine.abort(rid)
            self._release(1)
            self._count_finished("error")
            live.sink.put(("failed", live.index, f"{type(error).__name__}: {error}"))

    def _step(self) -> None:
        outputs = self.engine.step()  # contains per-request failures itself (finish_reason "error")
        now = time.perf_counter()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is not None:
                self._record(live, out, now)
                if out.error is not None:
                    live.sink.put(("failed", live.index, out.error))
                else:
                    live.sink.put(("output", live.index, out))
                if out.finished:
                    del self._live[out.request_id]
                    self._release(1)

    def _count_finished(self, reason: str) -> None:
        with self.stats.lock:
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

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
