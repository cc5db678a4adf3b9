"""An engine's compiled programs: counting them, compiling them ahead of need, keeping them
across processes.

- `CompileCounter` attributes XLA compiles to the engine whose call (or background compile)
  made them, through jax's monitoring events: a jitted function's executables are shared by
  every caller in the process, so a second engine of the same shapes and placements compiles,
  and counts, nothing. Programs loaded from the persistent cache are counted apart.
- `BackgroundCompiler` compiles a list of programs on one thread while the engine serves with
  those already compiled (`Engine.start_warmup`).
- `use_persistent_cache` points jax's compilation cache at `$JAXINFER_CACHE/xla`, so a second
  start of the same model and config loads its programs from disk instead of compiling them.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any

import jax
from jax import monitoring

logger = logging.getLogger(__name__)

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # every executable jax obtains
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # ... of which these came from the persistent cache
_attributed = threading.local()  # .counter: the CompileCounter collecting this thread's compiles


class CompileCounter:
    """Counts the executables jax obtains on a thread while it runs inside `attribute()`."""

    def __init__(self) -> None:
        self.obtained = 0  # compiled by XLA or loaded from the persistent cache
        self.from_cache = 0  # loaded from the persistent cache

    @property
    def compiled(self) -> int:
        """Executables XLA compiled for this counter's owner."""
        return self.obtained - self.from_cache

    def attribute(self) -> _Attribution:
        """`with counter.attribute(): ...`: compiles on this thread meanwhile count here."""
        return _Attribution(self)

    def call(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)`, its compiles counted here."""
        with self.attribute():
            return fn(*args)


class _Attribution:
    def __init__(self, counter: CompileCounter) -> None:
        self.counter = counter

    def __enter__(self) -> None:
        self.previous = getattr(_attributed, "counter", None)
        _attributed.counter = self.counter

    def __exit__(self, *exc) -> None:
        _attributed.counter = self.previous


def _on_duration(event: str, duration: float, **kwargs) -> None:
    counter = getattr(_attributed, "counter", None)
    if counter is not None and event == _BACKEND_COMPILE:
        counter.obtained += 1


def _on_event(event: str, **kwargs) -> None:
    counter = getattr(_attributed, "counter", None)
    if counter is not None and event == _CACHE_HIT:
        counter.from_cache += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


class BackgroundCompiler:
    """Compiles programs (`compile_one(key)`) in order on one daemon thread.

    The engine asks `claim(key)` before it runs a program: if the program is still queued it
    leaves the queue (the caller compiles it now, on its own thread), if it is being compiled
    the caller waits for it, so no program is ever compiled twice. A failed background compile
    is logged and left to the caller, whose own call then raises the real error."""

    def __init__(self, compile_one: Callable[[Hashable], None], keys: Iterable[Hashable]) -> None:
        self._compile_one = compile_one
        self._queue = list(keys)
        self._compiling: Hashable | None = None
        self._done: set[Hashable] = set()
        self._changed = threading.Condition()
        # A daemon thread, so it never keeps a process alive; `_stop_all_at_exit` lets its
        # compile in progress finish first (XLA aborts the process if it is cut off midway).
        self._thread = threading.Thread(target=self._run, name="jaxinfer-compile", daemon=True)
        _live.add(self)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                if not self._queue:
                    self._compiling = None
                    self._changed.notify_all()
                    return
                key = self._compiling = self._queue.pop(0)
            try:
                self._compile_one(key)
                ok = True
            except Exception:  # the caller's own call will raise it where it can be contained
                logger.exception("background compile of %s failed", key)
                ok = False
            with self._changed:
                if ok:
                    self._done.add(key)
                self._compiling = None
                self._changed.notify_all()

    def compiled(self, key: Hashable) -> bool:
        with self._changed:
            return key in self._done

    def claim(self, key: Hashable) -> None:
        """Make sure nobody else is compiling `key` (see the class docstring)."""
        with self._changed:
            if key in self._queue:
                self._queue.remove(key)
            while self._compiling == key:
                self._changed.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty; False if `timeout` ran out first."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def busy(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Drop what is still queued and wait for the compile in progress."""
        with self._changed:
            self._queue.clear()
        self._thread.join()


_live: weakref.WeakSet[BackgroundCompiler] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for compiler in list(_live):
        compiler.stop()


def default_cache_dir() -> Path:
    from jaxinfer.default_model import cache_dir

    return cache_dir() / "xla"


def use_persistent_cache(setting: bool | str | os.PathLike = True) -> Path | None:
    """Turn on jax's persistent compilation cache; returns its directory, or None when off.

    `setting`: True = `$JAXINFER_CACHE/xla` (unless `JAXINFER_COMPILATION_CACHE=0` is set in
    the environment), False = leave jax as it is, a path = that directory. The cache is
    process-wide: a directory the user (or an earlier engine) already gave jax is kept (a
    different one asked for here is then a warning). Every step program is cached, however
    fast it compiled: the second start of the same model and config then compiles none. A
    directory that cannot be made (a read-only home, a file in the way) is a warning, not an
    error: the engine compiles without the cache."""
    if setting is False or (setting is True and os.environ.get("JAXINFER_COMPILATION_CACHE", "1") == "0"):
        return None
    directory = default_cache_dir() if setting is True else Path(setting).expanduser()
    if current := jax.config.jax_compilation_cache_dir:
        if setting is not True and Path(current).resolve() != directory.resolve():
            logger.warning("compilation_cache=%s is not used: jax already caches compiled programs in %s "
                           "(one directory per process)", directory, current)
        directory = Path(current)
    else:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.warning("compiled programs are not cached across restarts: cannot make %s (%s)", directory, e)
            return None
        # (no jax_compilation_cache_max_size: jax's eviction fails every write into a cache that
        # was filled without it, as earlier starts filled this one)
        jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.default_backend() == "cpu":  # the GPU autotuning cache's path would enter every key: a moved cache missed
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    return directory
