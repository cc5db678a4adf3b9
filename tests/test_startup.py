"""Startup: programs compiled once, in the background while serving, and kept on disk so a
second start compiles none (`jaxinfer.programs`, `Engine.start_warmup`, `/health`)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import Model
from jaxinfer.programs import BackgroundCompiler
from jaxinfer.sampling import SamplingParams
from jaxinfer.server import build_server
from tiny_models import tiny_model

T = 120  # seconds a wait may take on a busy machine

# Two context buckets (4 and 8 pages) -> 4 programs.
CONFIG = EngineConfig(max_slots=4, page_size=8, max_model_len=64, prefill_chunk=8, min_context_bucket=32)


@pytest.fixture(scope="module")
def model() -> Model:
    config, params = tiny_model()
    return Model(config, params, None)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 90, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def test_warmup_compiles_each_program_once_and_traffic_nothing_more(model):
    eng = Engine(model, CONFIG)
    per_bucket = 1 + len(eng.decode_row_buckets)  # decode+prefill, decode-only per row bucket
    assert eng.warmup() == len(eng.program_keys()) == per_bucket * len(eng.context_buckets)
    compiled = len(eng.program_keys()) + 1  # and the block-table update (`kv.table_updates`)
    assert eng.metrics().obtained_programs == compiled
    eng.generate(prompts(6, seed=1), SamplingParams(max_tokens=20))
    assert eng.metrics().obtained_programs == compiled


def test_warmup_with_penalties_compiles_what_penalized_requests_run(model):
    """`warmup(penalized=True)` (what the server starts) also compiles the programs of requests
    with penalties, a logit bias or a grammar, and the penalty-row write: such requests then
    compile nothing, short or as long as the context allows."""
    eng = Engine(model, dataclasses.replace(CONFIG, max_slots=2))  # shapes no other test compiled
    assert eng.warmup(penalized=True) == len(eng.program_keys(penalized=True)) > len(eng.program_keys())
    compiled = eng.metrics().obtained_programs
    assert compiled == len(eng.program_keys(penalized=True)) + 2  # + block tables, penalty rows
    params = [SamplingParams(max_tokens=8, presence_penalty=0.5), SamplingParams(max_tokens=40, logit_bias={3: 2.0}),
              SamplingParams(max_tokens=8)]
    eng.generate([[5, 6, 7], list(range(1, 20)), [9, 8]], params)
    assert eng.metrics().obtained_programs == compiled


def test_warmup_with_logprobs_compiles_what_logprob_requests_run(model):
    """`warmup(logprobs=True)` (what the server starts) also compiles the logprob program, once
    per shape of a step's logits: requests that ask for logprobs then compile nothing. Without
    it the first such step compiles one."""
    sp = [SamplingParams(max_tokens=12, logprobs=2), SamplingParams(temperature=0.9, seed=1, max_tokens=30, logprobs=0),
          SamplingParams(max_tokens=5)]
    eng = Engine(model, dataclasses.replace(CONFIG, max_slots=3))  # shapes no other test compiled
    eng.warmup(logprobs=True)
    compiled = eng.metrics().obtained_programs
    logits_shapes = 1 + len(eng.decode_row_buckets)  # decode rows with prefill rows; each row bucket alone
    assert compiled == len(eng.program_keys()) + 1 + logits_shapes
    outs = eng.generate(prompts(3, seed=5), sp)
    assert [len(o.logprobs) for o in outs[:2]] == [12, 30]
    assert eng.metrics().obtained_programs == compiled
    plain = Engine(model, dataclasses.replace(CONFIG, max_slots=5))
    plain.warmup()
    compiled = plain.metrics().obtained_programs
    plain.generate(prompts(3, seed=5), sp)
    assert plain.metrics().obtained_programs > compiled


def test_background_warmup_serves_the_same_tokens_and_compiles_each_program_once(model):
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=24)
    reference = [o.token_ids for o in Engine(model, CONFIG).generate(prompts(6, seed=2), sp)]
    eng = Engine(model, CONFIG)
    eng.start_warmup()
    outs = eng.generate(prompts(6, seed=2), sp)  # served while the other programs compile
    assert [o.token_ids for o in outs] == reference
    assert eng.wait_for_warmup(T)
    assert eng.ready and not eng.warming_up
    # the jax caches are shared with the reference engine above: this one counts only what
    # it compiled itself, and never a program twice
    assert eng.metrics().obtained_programs <= len(eng.program_keys())
    eng.generate(prompts(3, seed=4), sp)
    assert eng.metrics().obtained_programs <= len(eng.program_keys())


def test_a_step_runs_the_smallest_compiled_bucket_that_fits(model):
    """While warm-up has compiled only the largest bucket, a short request runs there (and
    compiles nothing itself); the tokens are the same as in its own bucket."""
    eng = Engine(model, CONFIG)
    largest = [k for k in eng.program_keys() if k[0] == eng.context_buckets[-1]]
    for key in largest:
        eng._compile(key)
    eng._compile_side_programs()  # the block-table update, which warm-up compiles first
    eng._compiler = BackgroundCompiler(lambda key: None, [])  # warm-up "running", nothing more to come
    eng._compiler._done.update(largest)
    before = eng.metrics().obtained_programs
    widths = []
    dispatch = eng._dispatch
    eng._dispatch = lambda i, batch, *rest: widths.append(batch.width) or dispatch(i, batch, *rest)
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]
    assert set(widths) == {eng.context_buckets[-1]}
    assert eng.metrics().obtained_programs == before
    assert out.token_ids == Engine(model, CONFIG).generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids


def test_background_compiler_never_compiles_a_program_twice():
    started, release, compiled = threading.Event(), threading.Event(), []

    def compile_one(key):
        if key == "a":
            started.set()
            release.wait(T)
        compiled.append(key)

    bc = BackgroundCompiler(compile_one, ["a", "b", "c"])
    assert started.wait(T)
    bc.claim("c")  # still queued: the caller takes it over
    waiter = threading.Thread(target=bc.claim, args=("a",))  # being compiled: the caller waits
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()
    release.set()
    waiter.join(T)
    assert bc.wait(T)
    assert compiled == ["a", "b"] and bc.compiled("a") and bc.compiled("b") and not bc.compiled("c")


def test_a_failed_background_compile_is_left_to_the_step():
    def compile_one(key):
        raise RuntimeError("no")

    bc = BackgroundCompiler(compile_one, ["a"])
    assert bc.wait(T) and not bc.compiled("a")


def test_health_says_warming_up_with_503_until_ready(model, monkeypatch):
    from test_server import ServerThread

    release = threading.Event()
    compile_now = Engine._compile

    def held_compile(self, key):
        release.wait(T)
        compile_now(self, key)

    monkeypatch.setattr(Engine, "_compile", held_compile)
    s = ServerThread(build_server(model, CONFIG, "tiny"))
    try:
        r = httpx.get(f"{s.url}/health", timeout=T)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) > 0
        assert r.json()["status"] == "warming up"
        release.set()
        deadline = time.monotonic() + T
        while (r := httpx.get(f"{s.url}/health", timeout=T)).status_code == 503:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.1)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        release.set()
        s.stop()


# ---- persistent compilation cache: a second process compiles nothing -------------------------

START = """
import json, sys
sys.path.insert(0, {tests!r})
from tiny_models import tiny_model
from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingParams
config, params = tiny_model()
eng = Engine(Model(config, params, None), EngineConfig(max_slots=2, page_size=8, max_model_len=32,
                                                       compilation_cache={setting}))
eng.warmup()
out = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6))[0]
m = eng.metrics()
print(json.dumps(dict(compiled=m.compiled_programs, cached=m.cached_programs, tokens=out.token_ids,
                      programs=len(eng.program_keys()) + 1)))  # + the block-table update
"""


def start(tmp_path: Path, setting: str = "True", env_cache: str = "1") -> dict:
    suite_cache = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")  # conftest's: only the engine's own here
    env = {k: v for k, v in os.environ.items() if not k.startswith(suite_cache)}
    env.update(JAXINFER_CACHE=str(tmp_path), JAXINFER_COMPILATION_CACHE=env_cache)
    code = START.format(tests=str(Path(__file__).parent), setting=setting)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_start_compiles_nothing(tmp_path):
    first = start(tmp_path)
    assert first["compiled"] == first["programs"] and first["cached"] == 0
    assert any((tmp_path / "xla").iterdir())
    second = start(tmp_path)
    assert second["compiled"] == 0 and second["cached"] == first["programs"]
    assert second["tokens"] == first["tokens"]


def test_compilation_cache_opt_outs_write_nothing(tmp_path):
    for setting, env_cache in (("False", "1"), ("True", "0")):
        run = start(tmp_path, setting, env_cache)
        assert run["compiled"] == run["programs"] and run["cached"] == 0
        assert not (tmp_path / "xla").exists()


def test_models_loaded_for_scan_are_run_as_they_are(model, tmp_path):
    """load_model(layer_loop="scan") stacks the layers once; an engine scanning them keeps
    those very arrays (no second, stacked copy) and decodes the same tokens as unrolled."""
    from jaxinfer.checkpoint import save_orbax
    from jaxinfer.loading import load_model

    save_orbax(model.config, model.params, tmp_path / "m")
    stacked = load_model(tmp_path / "m", layer_loop="scan")
    assert len(stacked.params.layers) < model.config.n_layers or model.config.n_layers == 1
    eng = Engine(stacked, dataclasses.replace(CONFIG, layer_loop="scan", weight_layouts="one"))
    assert eng.model.params is stacked.params
    # more weight layouts add copies only: the loaded arrays are kept as they are
    every = Engine(stacked, dataclasses.replace(CONFIG, layer_loop="scan", weight_layouts="all")).model.params
    assert every.embed is stacked.params.embed and every.layers[0].stacked.wq.nk is stacked.params.layers[0].stacked.wq
    sp = SamplingParams(max_tokens=8)
    assert (eng.generate([[3, 4, 5]], sp)[0].token_ids
            == Engine(load_model(tmp_path / "m", layer_loop="unroll"), CONFIG).generate([[3, 4, 5]], sp)[0].token_ids)


def test_a_cache_directory_that_cannot_be_made_is_a_warning(tmp_path, caplog):
    """A read-only home or a file in the way costs the cache, not the engine; a directory
    asked for while jax already caches elsewhere is named in a warning (the cache is one per
    process)."""
    import logging

    import jax

    from jaxinfer.programs import use_persistent_cache

    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    kept = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with caplog.at_level(logging.WARNING, "jaxinfer.programs"):
            assert use_persistent_cache(blocker / "xla") is None
        assert jax.config.jax_compilation_cache_dir is None and "cannot make" in caplog.text
    finally:
        jax.config.update("jax_compilation_cache_dir", kept)
    if kept:  # (the suite shares one cache)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "jaxinfer.programs"):
            assert use_persistent_cache(tmp_path / "mine") == Path(kept)
        assert "is not used" in caplog.text


def test_the_engine_refuses_to_run_under_a_jax_transformation(model):
    """Called inside the user's jax.jit, the engine raises at once and stays unharmed (its
    state never takes a tracer)."""
    import jax

    eng = Engine(model, EngineConfig(max_slots=2, page_size=8, prefill_chunk=16, max_model_len=64))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    @jax.jit
    def inside(x):
        eng.generate([[1, 2, 3]], params)
        return x

    with pytest.raises(RuntimeError, match="under a jax transformation"):
        inside(1)
    with pytest.raises(RuntimeError, match="Engine.step"):
        jax.jit(lambda x: eng.step() and x)(1)
    out = eng.generate([[1, 2, 3]], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
