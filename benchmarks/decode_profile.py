"""Where a decode step's time goes (issue 22): one engine step at b = 1 and 16, part by part.

    python benchmarks/decode_profile.py [--bs 1 16] [--reps 10]

SmolLM2-135M, f32, XLA:CPU, the engine `benchmarks/decode.py` measures
(`EngineConfig(max_slots=b, max_model_len=128, prefill_chunk=64)`), every slot decoding
greedily at context 96 (`verify_profile.decode_batch`). For each batch size:

- the step program's time (median of `--reps` rounds, no profiler attached);
- a `jax.profiler` trace of the same program, each XLA:CPU thunk attributed to a part of the
  model by the Python stack that built it (the HLO's stack frames): each weight's matmul,
  LM head, embedding, norms, RoPE, paged KV write, attention (KV gather and the rest),
  sampling, other. Trace times are scaled to the unprofiled step (the profiler slows it);
- bytes per part from the HLO's shapes (operands + result of each thunk; an in-place
  update counts its update only), and XLA's `cost_analysis()` of the whole program against
  the bytes the step must read: every weight once plus the live KV;
- host: `Engine.step` wall time minus its device program, and the logprob program
  (`step_logprobs`, a separate program run only for steps emitting to a request that asked).

Last line: JSON with the parts (ms, MB) per batch size and the byte ratios.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import platform
import re
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from step_timer import StepTimer
from verify_profile import CONTEXT, Program, cost, decode_batch, timed

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import load_model
from jaxinfer.sampling import SamplingParams
from jaxinfer.step import step_logprobs

WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# Part of a thunk = the first of these functions found walking its stack from the innermost frame.
PART_OF_FUNCTION = {
    "lm_head": "lm_head", "sample_rows": "sampling", "sample_tokens": "sampling", "rms_norm": "norms",
    "apply_rope": "rope", "scatter_tokens": "kv_write", "write_indices": "indices", "gather_pages": "attn_gather",
    "paged_attention_reference": "attention", "attention_output": "attention", "attention_scores": "attention",
    "visible_keys": "attention", "swiglu_mlp": "mlp_act",
}


def engine_for(model, b: int) -> Engine:
    return Engine(model, EngineConfig(max_slots=b, max_model_len=128, prefill_chunk=64, max_prefill_rows=b,
                                      enable_prefix_caching=False))


class Hlo:
    """The compiled HLO text of a program: each instruction's result bytes, operands and the
    functions of the Python stack that built it."""

    def __init__(self, text: str, vocab_size: int):
        self.vocab_row_bytes = 4 * vocab_size  # an f32 logits row: the LM head's output is [rows, V]
        section = lambda name: re.search(rf"^{name}\n(.*?)(?:\n\n|\n[A-Z]|\Z)", text, re.S | re.M)
        functions = dict(re.findall(r'^(\d+) "(.*)"$', section("FunctionNames").group(1), re.M))
        locations = {i: functions[f] for i, f in
                     re.findall(r"^(\d+) \{file_name_id=\d+ function_name_id=(\d+)", section("FileLocations").group(1), re.M)}
        frames = {i: (locations[loc], parent) for i, loc, parent in
                  re.findall(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", section("StackFrames").group(1), re.M)}
        self.bytes, self.operands, self.stack = {}, {}, {}
        for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) [\w\-]+\((.*)$", text, re.M):
            name, shape, rest = m.groups()
            self.bytes[name] = shape_bytes(shape)
            self.operands[name] = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            frame, stack = re.search(r"stack_frame_id=(\d+)", rest), []
            frame = frame and frame.group(1)
            while frame in frames and len(stack) < 64:
                function, parent = frames[frame]
                stack.append(function)
                frame = None if parent == frame else parent
            self.stack[name] = stack  # innermost first

    def part(self, name: str, depth: int = 0) -> str:
        operands = self.operands.get(name, ())
        if "lm_head" in self.stack.get(name, ()) or (
                any("params_embed" in op for op in operands) and self.bytes[name] >= self.vocab_row_bytes):
            return "lm_head"
        weight = next((w for op in operands for w in WEIGHTS if re.search(rf"__{w}(_nk|_panels|_kn)?\b", op)), None)
        if weight is not None:
            return f"matmul {weight}"
        if any("params_embed" in op for op in operands):
            return "embedding"
        if not self.stack.get(name) and depth < 4:  # library fusions carry no stack: their inputs' part
            return next((self.part(op, depth + 1) for op in operands if op in self.stack), "other")
        return next((PART_OF_FUNCTION[f] for f in self.stack.get(name, ()) if f in PART_OF_FUNCTION), "other")

    def moved(self, name: str) -> int:
        """Bytes a thunk reads and writes, from shapes. An in-place update (an operand as large
        as the result) counts its other operands twice instead; outside matmuls, an operand 64x
        the result or more is indexed (a gather or slice of it) and counts as the result."""
        out = self.bytes.get(name, 0)
        sizes = [self.bytes.get(op, 0) for op in self.operands.get(name, ())]
        if out in sizes and ("dynamic-update-slice" in name or "scatter" in name):
            return 2 * (sum(sizes) - out)
        if not self.part(name).startswith(("matmul", "lm_head")):
            sizes = [out if size >= 64 * max(out, 1) else size for size in sizes]
        return sum(sizes) + out


def shape_bytes(shape: str) -> int:
    size = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "s8": 1, "u8": 1, "pred": 1}
    return sum(size.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape))


def traced_parts(program: Program, hlo: Hlo, calls: int = 5) -> tuple[dict[str, float], dict[str, int]]:
    """(seconds per call, bytes moved per call) of each part, from a profiler trace of
    `calls` calls: only what runs as a thunk counts."""
    trace_dir = Path(tempfile.mkdtemp())
    try:
        jax.profiler.start_trace(str(trace_dir))
        for _ in range(calls):
            program()
        jax.profiler.stop_trace()
        events = json.load(gzip.open(next(trace_dir.rglob("*.trace.json.gz"))))["traceEvents"]
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    seconds, moved = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"] in hlo.bytes:
            seconds[hlo.part(e["name"])] += e["dur"] * 1e-6 / calls
            moved[hlo.part(e["name"])] += hlo.moved(e["name"]) / calls
    return dict(seconds), dict(moved)


def host_ms(eng: Engine, b: int, steps: int = 16) -> float:
    """p50 of `Engine.step` wall time minus its device program (ms), decoding b requests."""
    for i in range(b):
        eng.add_request([100 + i] * CONTEXT, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    with StepTimer(eng) as timer:
        while eng.scheduler.waiting or any(r.num_computed < len(r.prompt) for r in eng.scheduler.running):
            eng.step()
        timer.reset()
        for _ in range(steps):
            eng.step()
    return timer.host_ms_per_step


def profile(model, b: int, reps: int) -> dict:
    eng = engine_for(model, b)
    batch = decode_batch(eng)
    fn, args = eng._program(batch, None, eng.kv, None)
    step = Program(fn, args, 2)
    hlo = Hlo(fn.lower(*args).compile().as_text(), model.config.vocab_size)
    vocab = model.config.vocab_size
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((b, vocab)), jnp.float32)
    logprobs = Program(step_logprobs, (logits, jnp.zeros(b, jnp.int32)), None)
    times = timed({"step": step, "logprobs": logprobs}, reps)
    parts, moved = traced_parts(step, hlo)
    scale = times["step"] / sum(parts.values())  # the profiler slows every thunk alike (roughly)

    c = model.config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    kv_token_bytes = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    live_kv = b * (CONTEXT + 1) * kv_token_bytes
    analysis = cost(fn, args)
    return {
        "step_ms": 1e3 * times["step"],
        "parts_ms": {k: 1e3 * v * scale for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "parts_mb": {k: v / 1e6 for k, v in moved.items()},
        "logprobs_program_ms": 1e3 * times["logprobs"],
        "host_ms": host_ms(eng, b),
        "xla_gflop": analysis["gflop"],
        "xla_mb": analysis["mb"],
        "weights_mb": weight_bytes / 1e6,
        "live_kv_mb": live_kv / 1e6,
        "bytes_over_needed": analysis["mb"] * 1e6 / (weight_bytes + live_kv),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    model = load_model(progress=False)
    summary = {"machine": f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__} {jax.default_backend()}",
               "load_before": os.getloadavg()[0]}
    for b in args.bs:
        r = profile(model, b, args.reps)
        print(f"\nbatch {b}: step {r['step_ms']:.2f} ms; XLA cost analysis {r['xla_mb']:.0f} MB, {r['xla_gflop']:.2f} GFLOP; "
              f"must read {r['weights_mb']:.0f} MB weights + {r['live_kv_mb']:.1f} MB live KV "
              f"(accessed / needed {r['bytes_over_needed']:.2f})")
        print(f"{'part':<16}{'ms':>9}{'share':>8}{'MB':>9}")
        for part, ms in r["parts_ms"].items():
            print(f"{part:<16}{ms:>9.2f}{ms / r['step_ms']:>8.1%}{r['parts_mb'].get(part, 0):>9.1f}")
        print(f"{'host':<16}{r['host_ms']:>9.2f}   (Engine.step wall minus the program)")
        print(f"{'logprobs':<16}{r['logprobs_program_ms']:>9.2f}   (separate program, only when a request asks)")
        summary[f"b{b}"] = {k: (round(v, 3) if isinstance(v, float) else {p: round(x, 3) for p, x in v.items()})
                            for k, v in r.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
