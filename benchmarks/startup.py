"""Startup cost of the default model (SmolLM2-135M) with the default `EngineConfig()`.

Each figure comes from a fresh subprocess (so nothing is warm that a user's first start
would not have):

- load_cpu_s: CPU seconds of `load_model()` (after `import jaxinfer`);
- warmup_cpu_s / compiled_programs: CPU seconds of `Engine.warmup()` (every program, no
  persistent compilation cache) and how many programs it compiled;
- first_token_s: wall seconds from starting `jaxinfer generate "..."` to its first output
  byte, with an empty compilation cache (the model file and its weight cache present);
- second_start_first_token_s: the same command again, its compilation cache now warm;
- scan_compile_ratio: compile CPU time of one engine program (decode + prefill, smallest
  bucket) with layers under `lax.scan` over the same program unrolled;
- bucket_step_ms: one decode step's wall ms at each context-bucket width (the gather width
  a short context pays without narrower buckets; warmup_cpu_s / compiled_programs is what
  one more bucket's two programs would cost);
- first_constrained_request_s: wall seconds of the first request with a JSON schema after
  `warmup()` and after `warmup(penalized=True)` (what `jaxinfer serve` compiles), and a plain
  request's beside them; penalized_warmup_cpu_s: CPU seconds of each warm-up.

    python benchmarks/startup.py            # 3-10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write one sentence about the sea."


def in_subprocess(code: str, env: dict | None = None) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOAD = """
import json, time
import jaxinfer
t = time.process_time()
jaxinfer.load_model(progress=False)
print(json.dumps({"load_cpu_s": time.process_time() - t}))
"""

WARMUP = """
import json, time
import jax
import numpy as np
from jaxinfer import load_model
from jaxinfer.engine import Engine, EngineConfig
engine = Engine(load_model(progress=False), EngineConfig(compilation_cache=False))
t = time.process_time()
engine.warmup()
warmup = time.process_time() - t
steps = {}
for width in engine.context_buckets:  # every program is compiled: this is run time only
    batch = engine._idle_batch(width, False, engine.config.max_slots)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        jax.block_until_ready(engine._dispatch(0, batch, None, None, []))
        times.append(time.perf_counter() - t)
    steps[width] = 1e3 * float(np.median(times[2:]))
print(json.dumps({"warmup_cpu_s": warmup, "compiled_programs": engine.metrics().compiled_programs,
                  "programs": len(engine.program_keys()), "bucket_step_ms": steps}))
"""

CONSTRAINED = """
import json, sys, time
from jaxinfer import SamplingParams, StructuredOutputsParams, load_model
from jaxinfer.engine import Engine, EngineConfig
engine = Engine(load_model(progress=False), EngineConfig(compilation_cache=False))
t = time.process_time()
engine.warmup(penalized={penalized})
warmup = time.process_time() - t
chat = [[{{"role": "user", "content": "Give the capital of France as JSON."}}]]
schema = StructuredOutputsParams(json={{"type": "object", "properties": {{"capital": {{"type": "string"}}}},
                                        "required": ["capital"]}})
out = {{"warmup_cpu_s": warmup}}
for name, params in (("plain", SamplingParams(max_tokens=16, temperature=0)),
                     ("constrained", SamplingParams(max_tokens=16, temperature=0, structured_outputs=schema))):
    t = time.perf_counter()
    engine.generate(chat, params)
    out[name] = time.perf_counter() - t
print(json.dumps(out))
"""

SCAN = """
import dataclasses, json, time
from jaxinfer import load_model
from jaxinfer.engine import Engine, EngineConfig
model = load_model(progress=False)
out = {}
for loop in ("unroll", "scan"):
    engine = Engine(model, EngineConfig(compilation_cache=False, layer_loop=loop))
    t = time.process_time()
    engine._compile(engine.program_keys()[0])
    out[loop] = time.process_time() - t
print(json.dumps({"compile_cpu_s": out}))
"""


def first_token_s(env: dict) -> float:
    """Wall seconds from starting `jaxinfer generate` to the first byte it prints."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer", "generate", "--max-tokens", "16", PROMPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    _, err = proc.communicate(timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"jaxinfer generate failed:\n{err.decode()[-4000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    from jaxinfer.default_model import DEFAULT_MODEL_FILENAME, default_model_path

    gguf = default_model_path(progress=True)  # fetched once, outside every measurement
    with tempfile.TemporaryDirectory() as tmp:
        # a cache directory of its own: the model (linked) and nothing compiled yet
        os.symlink(gguf, Path(tmp) / DEFAULT_MODEL_FILENAME)
        env = dict(os.environ, JAXINFER_CACHE=tmp)
        env.pop("JAXINFER_COMPILATION_CACHE", None)
        load = [in_subprocess(LOAD, env) for _ in range(2)]  # the first may build the weight cache
        print(f"load: {[round(x['load_cpu_s'], 2) for x in load]} CPU s", file=sys.stderr, flush=True)
        warm = in_subprocess(WARMUP, env)
        print(f"warmup: {warm}", file=sys.stderr, flush=True)
        first = first_token_s(env)
        second = first_token_s(env)
        print(f"first token: {first:.1f} s cold, {second:.1f} s with the compilation cache", file=sys.stderr, flush=True)
        constrained = {name: in_subprocess(CONSTRAINED.format(penalized=penalized), env)
                       for name, penalized in (("plain_warmup", False), ("penalized_warmup", True))}
        print(f"first constrained request: {constrained}", file=sys.stderr, flush=True)
    try:
        scan = in_subprocess(SCAN)["compile_cpu_s"]
        ratio = scan["scan"] / scan["unroll"]
        print(f"compile CPU s of one program: {scan}", file=sys.stderr, flush=True)
    except RuntimeError as e:
        print(f"scan comparison failed: {e}", file=sys.stderr)
        scan, ratio = None, None
    widths = {int(w): ms for w, ms in warm["bucket_step_ms"].items()}
    print(json.dumps({
        "load_cpu_s": round(load[-1]["load_cpu_s"], 2),
        "first_load_cpu_s": round(load[0]["load_cpu_s"], 2),
        "warmup_cpu_s": round(warm["warmup_cpu_s"], 1),
        "compiled_programs": warm["compiled_programs"],
        "first_token_s": round(first, 1),
        "second_start_first_token_s": round(second, 1),
        "scan_compile_ratio": None if ratio is None else round(ratio, 3),
        "compile_cpu_s": scan,
        "bucket_step_ms": {w: round(ms, 1) for w, ms in sorted(widths.items())},
        "first_constrained_request_s": {name: round(c["constrained"], 2) for name, c in constrained.items()},
        "first_plain_request_s": {name: round(c["plain"], 2) for name, c in constrained.items()},
        "penalized_warmup_cpu_s": {name: round(c["warmup_cpu_s"], 1) for name, c in constrained.items()},
    }))


if __name__ == "__main__":
    main()
