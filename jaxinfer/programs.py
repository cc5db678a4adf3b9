"""Per-engine dispatch caches, so `EngineMetrics.compiled_programs` counts one engine's programs.

Every `jax.jit` wrapper of one function (with the same options) shares a process-wide
dispatch cache, so `f._cache_size()` counts the programs of every engine in the process.
Wrappers made inside `own_dispatch_cache()` get a cache of their own instead: their
`_cache_size()` counts the signatures called through them. Tracing, lowering and
compiling stay shared (jax keys those caches on the function), so a second engine with
the same shapes compiles nothing: it finds the first one's executables (measured on the
tiny test model: warmup 6.7 s for the first engine, 0.013 s for the second).

This is the one place jaxinfer reaches into jax internals (`jax._src`): jax offers no
public way to give a jitted function its own dispatch cache. Where a jax release lacks them,
engines still run (sharing one cache: `compiled_programs` then counts the process's programs);
tests/test_engine.py (`test_each_engine_counts_only_its_own_programs`) fails to flag it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

CAPACITY = 1024  # signatures per cache (an engine needs a few per context bucket and draft width)


@contextlib.contextmanager
def own_dispatch_cache() -> Iterator[None]:
    """`jax.jit` wrappers created in this block share one new dispatch cache (only theirs)."""
    try:
        from jax._src import config as jax_config
        from jax._src import pjit

        scope = jax_config.jax_jit_cpp_cache_obj(pjit.make_jit_cpp_cache(CAPACITY))
    except (ImportError, AttributeError):  # a jax without the hook: the shared cache
        scope = contextlib.nullcontext()
    with scope:
        yield
