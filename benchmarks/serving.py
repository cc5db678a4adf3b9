"""Serving throughput on SmolLM2-135M (f32, CPU): continuous vs static batching vs transformers,
and prefix caching on a shared system prompt. One run; last line: one JSON object.

    python benchmarks/serving.py [--requests 64] [--prefix-requests 32]

Trace: prompt and output lengths drawn from log-normal (long-tailed) distributions with a
fixed seed; greedy, EOS ignored so every system produces exactly the requested tokens.
Throughput = requested output tokens / wall time, prefill included.
  continuous   Engine, max_slots 16: requests join and leave between iterations; decode-only
               steps run the smallest row bucket (1, 4, 16) holding the decoding requests
  static       the same Engine with scheduling="static": batches of 16 that run until their
               longest member finishes, all 16 decode rows each step (as transformers does)
  full rows    continuous with every step at 16 decode rows (`decode_row_buckets=(16,)`, the
               engine before row buckets): `rows_speedup` = continuous / this
  static shrinking  static batches whose decode rows shrink with them (row buckets 1, 4, 16):
               `continuous_over_static_shrinking`, the stricter baseline
  hf_static    transformers generate, batches of 16 (left-padded) run to the longest output
Long tail: a second trace whose output lengths spread like chat logs (log-normal, p99/p50 >= 8),
continuous vs static only (`continuous_over_static_longtail`).
Host: for the continuous runs, the host time per engine step (p50 of `Engine.step` wall time
minus its device program) and the fraction of wall time no program ran (`device_idle_frac`;
the engine is synchronous, so that is the host's share).
Async: the continuous run again with `EngineConfig(async_scheduling=True)` (step n + 1 is
dispatched before step n's tokens are read) against the synchronous engine, alternating,
best of 2 each, timed by the wall clock only (`async_over_sync`).
Prefix: requests = one 512-token system prompt + a short question each, max_slots 16, with
and without the prefix cache: prompt tokens computed and mean time to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
from step_timer import StepTimer

SLOTS = 16


def trace(n: int, seed: int = 0, output_median: float = 24, output_sigma: float = 0.9,
          output_max: int = 256) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(48), 0.9, n), 4, 512).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(output_median), output_sigma, n), 2, output_max).astype(int)
    prompts = [rng.integers(100, 40_000, int(p)).tolist() for p in prompt_lens]
    return prompts, output_lens.tolist()


def longtail_trace(n: int) -> tuple[list[list[int]], list[int]]:
    """Outputs log-normal with sigma 1.4 (p99/p50 ~ 26 before the cap at 512)."""
    return trace(n, seed=2, output_median=12, output_sigma=1.4, output_max=512)


def tail_ratio(outputs: list[int]) -> float:
    return float(np.percentile(outputs, 99) / np.percentile(outputs, 50))


def engine_throughput(model, prompts, outputs, scheduling: str, rows: tuple[int, ...] | None = None
                      ) -> tuple[float, int, StepTimer]:
    """`rows`: `EngineConfig.decode_row_buckets` (None: the default for `scheduling`)."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    engine = Engine(model, EngineConfig(max_slots=SLOTS, max_model_len=1024, prefill_chunk=64,
                                        scheduling=scheduling, enable_prefix_caching=False, decode_row_buckets=rows))
    engine.warmup()
    compiled = engine.metrics().obtained_programs
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    with StepTimer(engine) as timer:
        outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == list(outputs)
    return sum(outputs) / timer.wall, engine.metrics().obtained_programs - compiled, timer


def async_over_sync(model, prompts, outputs, repeats: int = 2) -> tuple[float, float]:
    """(synchronous, asynchronous) continuous-batching tok/s, best of `repeats` alternating runs."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    engines = {a: Engine(model, EngineConfig(max_slots=SLOTS, max_model_len=1024, prefill_chunk=64,
                                             enable_prefix_caching=False, async_scheduling=a)) for a in (False, True)}
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    best = {False: 0.0, True: 0.0}
    for engine in engines.values():
        engine.warmup()
    for _ in range(repeats):
        for a, engine in engines.items():
            start = time.perf_counter()
            engine.generate(prompts, params)
            best[a] = max(best[a], sum(outputs) / (time.perf_counter() - start))
    return best[False], best[True]


def hf_static_throughput(prompts, outputs) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxinfer.default_model import default_model_path

    torch.set_num_threads(2)
    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    for start in range(0, len(prompts), SLOTS):
        batch, outs = prompts[start : start + SLOTS], outputs[start : start + SLOTS]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), do_sample=False, pad_token_id=0)
    return sum(outputs) / (time.perf_counter() - t0)


def prefix_run(model, n: int, cache: bool) -> tuple[int, float]:
    """-> (prompt tokens computed, mean time to first token)."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    rng = np.random.default_rng(1)
    system = rng.integers(100, 40_000, 512).tolist()
    prompts = [system + rng.integers(100, 40_000, int(rng.integers(8, 24))).tolist() for _ in range(n)]
    engine = Engine(model, EngineConfig(max_slots=SLOTS, max_model_len=1024, prefill_chunk=64,
                                        enable_prefix_caching=cache))
    engine.warmup()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    computed = sum(len(o.prompt_token_ids) - o.metrics.num_cached_prompt_tokens for o in outs)
    return computed, float(np.mean([o.metrics.time_to_first_token for o in outs]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--only", help=argparse.SUPPRESS)  # "hf": run the transformers part in a fresh process
    args = parser.parse_args()
    prompts, outputs = trace(args.requests)
    if args.only == "hf":
        print(hf_static_throughput(prompts, outputs))
        return

    from jaxinfer.loading import load_model

    model = load_model()
    print(f"trace: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))} "
          f"(max {max(map(len, prompts))}), output tokens {sum(outputs)} (max {max(outputs)})", flush=True)
    cont, compiles, timer = engine_throughput(model, prompts, outputs, "continuous")
    print(f"continuous: {cont:.1f} tok/s, compiles after warm-up: {compiles}; host {timer.host_ms_per_step:.2f} ms/step "
          f"(p50), device idle {timer.device_idle_frac:.3f} of the wall time", flush=True)
    static, _, _ = engine_throughput(model, prompts, outputs, "static")
    print(f"static:     {static:.1f} tok/s", flush=True)
    full, _, _ = engine_throughput(model, prompts, outputs, "continuous", (SLOTS,))
    shrinking, _, _ = engine_throughput(model, prompts, outputs, "static", (1, 4))
    print(f"continuous with all {SLOTS} rows: {full:.1f} tok/s; static with shrinking rows: {shrinking:.1f} tok/s", flush=True)
    tail_prompts, tail_outputs = longtail_trace(args.requests)
    tail_cont, _, tail_timer = engine_throughput(model, tail_prompts, tail_outputs, "continuous")
    tail_static, _, _ = engine_throughput(model, tail_prompts, tail_outputs, "static")
    tail_full, _, _ = engine_throughput(model, tail_prompts, tail_outputs, "continuous", (SLOTS,))
    tail_shrinking, _, _ = engine_throughput(model, tail_prompts, tail_outputs, "static", (1, 4))
    print(f"long tail (outputs p99/p50 {tail_ratio(tail_outputs):.1f}, {sum(tail_outputs)} tokens, max {max(tail_outputs)}): "
          f"continuous {tail_cont:.1f} tok/s, static {tail_static:.1f} tok/s, all rows {tail_full:.1f}, static shrinking "
          f"{tail_shrinking:.1f}; host {tail_timer.host_ms_per_step:.2f} ms/step, "
          f"device idle {tail_timer.device_idle_frac:.3f}", flush=True)
    sync_tok_s, async_tok_s = async_over_sync(model, prompts, outputs)
    print(f"async scheduling: {async_tok_s:.1f} tok/s vs synchronous {sync_tok_s:.1f} tok/s (best of 2 each)", flush=True)
    hf = float(subprocess.run([sys.executable, __file__, "--only", "hf", "--requests", str(args.requests)],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    print(f"hf static:  {hf:.1f} tok/s", flush=True)
    computed_off, ttft_off = prefix_run(model, args.prefix_requests, cache=False)
    computed_on, ttft_on = prefix_run(model, args.prefix_requests, cache=True)
    print(f"prefix: computed {computed_on} vs {computed_off} prompt tokens; mean TTFT {ttft_on:.2f} s vs {ttft_off:.2f} s")
    print(f"# {platform.machine()}, {os.cpu_count()} cpus, f32, greedy, max_slots {SLOTS}")
    print(json.dumps({
        "continuous_tok_s": round(cont, 1), "static_tok_s": round(static, 1),
        "continuous_over_static": round(cont / static, 2), "hf_static_tok_s": round(hf, 1),
        "continuous_over_hf": round(cont / hf, 2),
        "prefix_prefill_saved_frac": round(1 - computed_on / computed_off, 3),
        "prefix_ttft_ratio": round(ttft_on / ttft_off, 3), "compiles_after_warmup": compiles,
        "continuous_over_static_longtail": round(tail_cont / tail_static, 2), "longtail_p99_over_p50": round(tail_ratio(tail_outputs), 1),
        "full_rows_tok_s": round(full, 1), "rows_speedup": round(cont / full, 2),
        "rows_speedup_longtail": round(tail_cont / tail_full, 2),
        "continuous_over_static_shrinking": round(cont / shrinking, 2),
        "continuous_over_static_shrinking_longtail": round(tail_cont / tail_shrinking, 2),
        "host_ms_per_step": round(timer.host_ms_per_step, 3), "device_idle_frac": round(timer.device_idle_frac, 4),
        "host_ms_per_step_longtail": round(tail_timer.host_ms_per_step, 3),
        "device_idle_frac_longtail": round(tail_timer.device_idle_frac, 4),
        "async_tok_s": round(async_tok_s, 1), "async_over_sync": round(async_tok_s / sync_tok_s, 3),
    }))


if __name__ == "__main__":
    main()
