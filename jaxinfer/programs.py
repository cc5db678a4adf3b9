"""Which compiled programs are an engine's own, so `EngineMetrics.compiled_programs` never
counts another engine's.

A jitted function's dispatch cache is shared by every caller in the process (which is what
lets a second engine of the same shapes reuse the first one's executables). `CompileCounter`
attributes to its owner the cache entries that appear during the owner's own calls: the
programs compiled for it. Steady state is when this stops growing; a second engine with the
same shapes and placements counts 0. Engines are driven from one thread each; two engines
stepping at the same instant on two threads could see each other's new entries.
"""

from __future__ import annotations

from typing import Any, Callable


class CompileCounter:
    """Counts the programs jitted functions compile during calls made through `call`."""

    def __init__(self) -> None:
        self.programs = 0

    def call(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)`; when `fn` is a `jax.jit` function, the signatures it compiled are counted here."""
        cache_size = getattr(fn, "_cache_size", None)
        if cache_size is None:  # not a jitted function (a user's or a test's wrapper): nothing to count
            return fn(*args)
        before = cache_size()
        out = fn(*args)
        self.programs += max(cache_size() - before, 0)  # shrinks only if jax.clear_caches() ran
        return out
