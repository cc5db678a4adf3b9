"""The serving engine on a GPU or TPU: decode throughput with the Pallas kernels vs the XLA reference.

A random-weight model with Llama-3.2-1B's shapes (16 layers, d_model 2048, 32 query / 8 KV
heads of 64, FFN 8192, vocab 128,256; bf16; speed does not depend on the weights' values)
serves `--batch` prompts of `--prompt-tokens` random tokens (prefill chunks of 512, 8 rows a
step), greedy, `--new-tokens` each, through `Engine.generate`, once per configuration, side by
side in one process:

  reference   attention_impl="reference" (XLA gathers the pages), bf16 cache
  auto        attention_impl="auto" (the dispatch's kernels: Triton decode, Mosaic GPU
              prefill on Hopper), bf16 cache
  auto_int8   the kernels over an int8 cache
  auto_async  the kernels with asynchronous scheduling (the host prepares step n+1 while step
              n runs: on the H200 a small batch's step took 6x its weight and KV reads)

Decode throughput = (new tokens - 1) x batch / (time(generate N) - time(generate 1)), so the
prefill and the first token are excluded; host scheduling is included (it is what users get).
Each engine's compile counter is read before and after the timed runs: a steady state
compiles nothing. One more run of each synchronous config under `step_timer.StepTimer` splits
a step into host work and its program (p50s) and gives the fraction of the wall time the
device idles. Greedy tokens of auto and reference are compared (bf16 sums in another order
can flip a near-tie, so this is reported, not asserted; benchmarks/device_check.py checks
the kernels' numerics).

Last line, one JSON object: device, {config}_tok_s, auto_over_reference, int8_over_bf16,
async_over_sync, host_ms_per_step and device_idle_frac (of auto), steady_state_compiles,
first_token_match_frac (after the prefill), greedy_match_frac, fallbacks. Without a GPU or
TPU it says so and prints nulls.

    python benchmarks/engine_gpu.py [--batch 64] [--prompt-tokens 2048] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from step_timer import StepTimer

CONFIGS = {"reference": dict(attention_impl="reference"), "auto": dict(attention_impl="auto"),
           "auto_int8": dict(attention_impl="auto", kv_cache="int8"),
           "auto_async": dict(attention_impl="auto", async_scheduling=True)}
KEYS = [f"{name}_tok_s" for name in CONFIGS] + ["auto_over_reference", "int8_over_bf16", "async_over_sync",
                                                 "host_ms_per_step", "device_idle_frac", "steady_state_compiles",
                                                 "first_token_match_frac", "greedy_match_frac", "fallbacks"]


def llama_1b_shapes():
    from jaxinfer.config import ModelConfig
    from jaxinfer.loading import Model
    from jaxinfer.model import init_random_params

    config = ModelConfig(arch="llama", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         head_dim=64, ffn_dim=8192, rope_theta=500000.0, max_position=8192, dtype="bfloat16")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), init_random_params(config, seed=0))
    return Model(config, params, None, source="random Llama-3.2-1B shapes")


def run_config(model, ids: list[list[int]], new_tokens: int, **engine_args) -> dict:
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    b, prompt = len(ids), len(ids[0])
    engine = Engine(model, EngineConfig(max_slots=b, max_model_len=prompt + new_tokens, prefill_chunk=min(prompt, 512),
                                        max_prefill_rows=min(b, 8), enable_prefix_caching=False, **engine_args))

    def run(n: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = engine.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0, [o.token_ids for o in outs]

    t0 = time.perf_counter()
    _, tokens = run(new_tokens)  # compiles the prefill and decode programs
    run(1)
    warm = time.perf_counter() - t0
    before = engine.metrics().obtained_programs
    dt = min(run(new_tokens)[0] for _ in range(2)) - min(run(1)[0] for _ in range(2))
    split = dict(host_ms=None, program_ms=None, device_idle_frac=None)
    if not engine_args.get("async_scheduling"):  # the timer waits on each program: it would serialize async steps
        with StepTimer(engine) as timer:
            run(new_tokens)
        split = dict(host_ms=timer.host_ms_per_step, program_ms=1e3 * float(np.median(timer.device)),
                     device_idle_frac=timer.device_idle_frac)
    return dict(tok_s=(new_tokens - 1) * b / dt, warmup_s=warm, tokens=tokens,
                steady_state_compiles=engine.metrics().obtained_programs - before,
                fallbacks=sorted(set(engine.fallbacks.values())), **split)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = p.parse_args(argv)
    if jax.default_backend() not in ("gpu", "tpu"):
        print(f"no GPU or TPU found (JAX backend: {jax.default_backend()}): nothing run")
        print(json.dumps(dict.fromkeys(["device", *KEYS])))
        return 0
    device = jax.devices()[0].device_kind
    model = llama_1b_shapes()
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch, args.prompt_tokens)).tolist()
    print(f"device: {device}, jax {jax.__version__}; {model.source}, batch {args.batch}, "
          f"prompt {args.prompt_tokens}, new {args.new_tokens}")
    print("| device | config | decode tok/s | host ms / step | program ms / step | device idle | warm-up s | "
          "steady-state compiles | fallbacks |\n|---|---|---|---|---|---|---|---|---|")
    results = {}
    for name in args.configs:
        r = results[name] = run_config(model, ids, args.new_tokens, **CONFIGS[name])
        split = " | ".join("-" if r[k] is None else f"{r[k]:.2f}" for k in ("host_ms", "program_ms", "device_idle_frac"))
        print(f"| {device} | {name} | {r['tok_s']:.0f} | {split} | {r['warmup_s']:.1f} | {r['steady_state_compiles']} | "
              f"{', '.join(r['fallbacks']) or '-'} |", flush=True)
    tok = {name: r["tok_s"] for name, r in results.items()}
    out = {f"{name}_tok_s": round(t, 1) for name, t in tok.items()}
    if {"auto", "reference"} <= tok.keys():
        auto, ref = (np.asarray(results[name]["tokens"]) for name in ("auto", "reference"))  # i32[batch, new]
        out |= dict(auto_over_reference=round(tok["auto"] / tok["reference"], 3),
                    first_token_match_frac=round(float(np.mean(auto[:, 0] == ref[:, 0])), 3),
                    greedy_match_frac=round(float(np.mean(auto == ref)), 3))
    if {"auto", "auto_int8"} <= tok.keys():
        out["int8_over_bf16"] = round(tok["auto_int8"] / tok["auto"], 3)
    if {"auto", "auto_async"} <= tok.keys():
        out["async_over_sync"] = round(tok["auto_async"] / tok["auto"], 3)
    if "auto" in results:
        out |= dict(host_ms_per_step=round(results["auto"]["host_ms"], 3),
                    device_idle_frac=round(results["auto"]["device_idle_frac"], 3))
    out |= dict(steady_state_compiles=sum(r["steady_state_compiles"] for r in results.values()),
                fallbacks=sorted({f for r in results.values() for f in r["fallbacks"]}))
    print(json.dumps(dict(device=device) | dict.fromkeys(KEYS) | out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
