"""Verification cost (issue 18): the speculative verify program against the plain step.

    python benchmarks/verify_profile.py [--ks 2 4] [--bs 1 8] [--reps 7]

SmolLM2-135M, f32, XLA:CPU. For each batch b, an engine with n-gram speculation
(`EngineConfig(max_slots=b, page_size=32, max_model_len=256, prefill_chunk=128)`) supplies
the two jitted programs at their real shapes: the plain step (`engine_step`, a [b, 1]
decode group) and the verifying step (`speculative_step`, a [b, k + 1] block), both with
no prefill group, every row greedy and decoding at context 96, every slot verifying k
n-gram drafts. Beside them, small jitted programs of each part at the same shapes:

  layers    the target forward (`forward_groups`) minus its LM head
  lm_head   final logits, [b * T, D] x [D, V]
  sampling  `sample_tokens` (plain) / `verify_step` (verify) on the logits, greedy rows
  top_k     the same with every row sampled at temperature 1, top-k 50 (not in the step's
            time, which is greedy)
  logprobs  `token_logprobs` of the emitted tokens (log_softmax + top-5 over V): inside
            the step program before issue 18, a program apart since (run only for steps
            emitting to a request that asked), so not part of the step's time
  other     the step program minus the parts above in it (keys, gathers, copies, dispatch)
  draft     n-gram prompt lookup on the host, b slots
  host      `Engine.step` wall time minus its device program, minus the draft

Programs run interleaved, `--reps` rounds of 3 calls each (the machine is shared: the
figures are medians and the costs are ratios taken in one process). The last line is JSON
with `verify_cost_k{k}_b{b}` = verify program time / plain step time, plus every part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from step_timer import StepTimer

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import load_model
from jaxinfer.model import TokenGroup, forward_groups
from jaxinfer.model.transformer import lm_head
from jaxinfer.sampling import SamplingArrays, SamplingParams, row_keys, sample_tokens, token_logprobs
from jaxinfer.speculative.config import SpeculativeConfig
from jaxinfer.speculative.drafts import propose_ngram
from jaxinfer.speculative.step import DraftBatch
from jaxinfer.speculative.verify import Proposal, verify_step

CONTEXT = 96  # tokens cached per slot before the step
CALLS = 3  # calls per timed round


def engine_for(model, b: int, k: int) -> Engine:
    return Engine(model, EngineConfig(max_slots=b, page_size=32, max_model_len=256, prefill_chunk=128,
                                      enable_prefix_caching=False, speculative=SpeculativeConfig("ngram", k)))


def decode_batch(eng: Engine):
    """Every slot decoding greedily at CONTEXT, its pages laid out one after another (written
    into the engine's device block tables, as its table updates would)."""
    b, pages = eng.spec.max_slots, eng.spec.max_pages_per_seq
    batch = eng._idle_batch(eng.context_buckets[-1], with_prefill=False, rows=b)
    block_tables = 1 + np.arange(b * pages, dtype=np.int32).reshape(b, pages)  # i32[b, pages]
    eng.kv = dataclasses.replace(eng.kv, block_tables=jax.device_put(block_tables, eng.kv.block_tables.sharding))
    return dataclasses.replace(batch, lengths=np.full(b, CONTEXT, np.int32),
                               decode_tokens=np.arange(100, 100 + b, dtype=np.int32),
                               decode_active=np.ones(b, bool))


class Program:
    """A jitted program and its arguments; `kv_index`: the argument holding the cache it
    donates, given a copy of its own (so programs never donate each other's) and threaded
    through calls."""

    def __init__(self, fn, args: tuple, kv_index: int | None):
        self.fn, self.args, self.kv_index = fn, list(args), kv_index
        if kv_index is not None:
            self.args[kv_index] = jax.tree.map(jnp.copy, self.args[kv_index])

    def __call__(self):
        self.out = out = self.fn(*self.args)
        if self.kv_index is not None:
            self.args[self.kv_index] = out[0]
        jax.block_until_ready(out)


def part_programs(eng: Engine, batch, t: int, drafts: DraftBatch | None) -> dict[str, Program]:
    """Each part of a step with a [b, t] decode group, jitted alone at the same shapes."""
    m = eng.model
    b, d, v = eng.spec.max_slots, m.config.d_model, m.config.vocab_size
    tokens = np.concatenate([batch.decode_tokens[:, None]] + ([] if drafts is None else [drafts.tokens]), axis=1)
    group = TokenGroup(tokens=jnp.asarray(tokens), positions=jnp.asarray(batch.lengths[:, None] + np.arange(t)),
                       slots=jnp.arange(b, dtype=jnp.int32), num_new=jnp.full(b, t, jnp.int32),
                       logits_index=jnp.zeros(b, jnp.int32) if t == 1 else None, by_replica=True)

    @jax.jit
    def forward(params, kv, block_tables, lengths):
        kv = dataclasses.replace(kv, block_tables=block_tables, lengths=lengths)
        logits, kv = forward_groups(params, m.config, kv, (group,))
        return kv, logits[0]

    forward = jax.jit(forward.__wrapped__, donate_argnums=1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b * t, d)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((b, t, v)) * 3, jnp.float32)  # f32[b, t, V]
    greedy = jax.tree.map(jnp.asarray, batch.sampling)
    top_k = jax.tree.map(jnp.asarray, SamplingArrays.from_params([SamplingParams(top_k=50)] * b, range(b)))
    positions = jnp.asarray(batch.lengths + 1)
    if drafts is None:
        sample = jax.jit(lambda logits, s: sample_tokens(logits[:, 0], s, positions))
        emitted = jnp.zeros((b, 1), jnp.int32)
    else:
        proposal = Proposal(jnp.asarray(drafts.tokens), None)
        num_draft = jnp.asarray(drafts.num_draft)
        sample = jax.jit(lambda logits, s: verify_step(
            logits, proposal, num_draft, s, jax.vmap(jax.random.split)(row_keys(s.seed, positions))[:, 0], positions))
        emitted = jnp.zeros((b, t), jnp.int32)
    if t == 1:  # the plain step's decode logits are f32[b, V]
        logprobs = jax.jit(lambda logits: token_logprobs(logits[:, 0], emitted[:, 0]))
    else:
        logprobs = jax.jit(lambda logits: token_logprobs(logits, emitted))
    return {
        "forward": Program(forward, (m.params, eng.kv, eng.kv.block_tables[:, : batch.width], jnp.asarray(batch.lengths)), 1),
        "lm_head": Program(jax.jit(lm_head), (m.params, x), None),
        "sampling": Program(sample, (logits, greedy), None),
        "sampling_top_k": Program(sample, (logits, top_k), None),
        "logprobs": Program(logprobs, (logits,), None),
    }


def timed(programs: dict[str, Program], reps: int) -> dict[str, float]:
    """Median seconds per call of each program, the programs interleaved round by round."""
    for p in programs.values():  # compile and warm
        p()
        p()
    rounds = {name: [] for name in programs}
    for _ in range(reps):
        for name, p in programs.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                p()
            rounds[name].append((time.perf_counter() - start) / CALLS)
    return {name: statistics.median(r) for name, r in rounds.items()}


def cost(fn, args) -> dict[str, float]:
    """XLA's cost analysis of the compiled program: GFLOP and MB accessed."""
    analysis = fn.lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return {"gflop": analysis.get("flops", 0.0) / 1e9, "mb": analysis.get("bytes accessed", 0.0) / 1e6}


def host_overhead(model, b: int, k: int, steps: int = 16) -> tuple[float, float]:
    """(host seconds per `Engine.step` beyond its device program, n-gram lookup seconds per
    step for b slots), from a speculating engine decoding b copies of a repetitive prompt."""
    eng = engine_for(model, b, k)
    eng.warmup()
    prompt = ("one two three four five six seven eight nine ten " * 6).strip()
    for _ in range(b):
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=180, ignore_eos=True))
    with StepTimer(eng) as timer:
        while eng.scheduler.waiting or any(r.num_computed < len(r.prompt) for r in eng.scheduler.running):  # past prefill
            eng.step()
        timer.reset()
        for _ in range(steps):
            eng.step()
    history = np.asarray(eng.scheduler.running[0].all_tokens, np.int32)  # still running: 16 steps emit < 100 tokens
    start = time.perf_counter()
    for _ in range(steps):
        for _ in range(b):
            propose_ngram(history, k)
    draft = (time.perf_counter() - start) / steps
    return float(np.mean(timer.host)) - draft, draft


def measure_verify_cost(model, k: int, b: int, reps: int = 8) -> float:
    """Verify program time (k full-length drafts) / plain step time at batch b, greedy rows:
    the `verify_cost_k{k}_b{b}` figure alone (`benchmarks/speculative.py` reports it)."""
    eng = engine_for(model, b, k)
    batch = decode_batch(eng)
    drafts = DraftBatch(tokens=np.tile(np.arange(200, 200 + k, dtype=np.int32), (b, 1)), num_draft=np.full(b, k, np.int32))
    times = timed({"plain": Program(*eng._program(batch, None, eng.kv, None), 2),
                   "verify": Program(*eng._program(batch, drafts, eng.kv, eng.draft_kv), 2)}, reps)
    return times["verify"] / times["plain"]


def profile(model, b: int, ks: list[int], reps: int) -> dict:
    eng = engine_for(model, b, max(ks))
    batch = decode_batch(eng)
    results = {}
    plain_fn, plain_args = eng._program(batch, None, eng.kv, None)
    programs = {"plain": Program(plain_fn, plain_args, 2)}
    costs = {"plain": cost(plain_fn, plain_args)}
    for name, p in part_programs(eng, batch, 1, None).items():
        programs[f"plain.{name}"] = p
    for k in ks:
        drafts = DraftBatch(tokens=np.tile(np.arange(200, 200 + k, dtype=np.int32), (b, 1)),
                            num_draft=np.full(b, k, np.int32))
        fn, args = eng._program(batch, drafts, eng.kv, eng.draft_kv)
        costs[f"k{k}"] = cost(fn, args)
        programs[f"k{k}"] = Program(fn, args, 2)
        for name, p in part_programs(eng, batch, k + 1, drafts).items():
            programs[f"k{k}.{name}"] = p
    times = timed(programs, reps)
    # Before issue 18 the step programs computed logprobs themselves; since, they return logits
    # and the logprob program runs apart, only for steps emitting to a request that asked.
    in_program = hasattr(programs["plain"].out[-1], "decode_logprobs")
    host, draft = host_overhead(model, b, max(ks))
    for label in ["plain"] + [f"k{k}" for k in ks]:
        t = times[label]
        part = {name: times[f"{label}.{name}"] for name in ("forward", "lm_head", "sampling", "sampling_top_k", "logprobs")}
        results[label] = {
            "program_ms": 1e3 * t,
            "layers_ms": 1e3 * (part["forward"] - part["lm_head"]),
            "lm_head_ms": 1e3 * part["lm_head"],
            "sampling_ms": 1e3 * part["sampling"],
            "top_k_ms": 1e3 * part["sampling_top_k"],
            "logprobs_ms": 1e3 * part["logprobs"],
            "other_ms": 1e3 * (t - part["forward"] - part["sampling"] - in_program * part["logprobs"]),
            "draft_ms": 0.0 if label == "plain" else 1e3 * draft,
            "host_ms": 1e3 * host,
            **costs[label],
        }
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    model = load_model(progress=False)
    summary = {"machine": f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__} {jax.default_backend()}"}
    cols = ["program_ms", "layers_ms", "lm_head_ms", "sampling_ms", "top_k_ms", "logprobs_ms", "other_ms", "draft_ms", "host_ms",
            "gflop", "mb"]
    print(f"{'program':<10}{'b':>3}" + "".join(f"{c[:-3] if c.endswith('_ms') else c:>10}" for c in cols) + f"{'cost':>8}")
    for b in args.bs:
        res = profile(model, b, args.ks, args.reps)
        base = res["plain"]["program_ms"]
        for label, row in res.items():
            ratio = row["program_ms"] / base
            print(f"{label:<10}{b:>3}" + "".join(f"{row[c]:>10.2f}" for c in cols) + f"{ratio:>8.2f}")
            summary[f"{label}_b{b}"] = {c: round(row[c], 3) for c in cols}
            if label != "plain":
                summary[f"verify_cost_{label}_b{b}"] = round(ratio, 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
