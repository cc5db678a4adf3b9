"""SmolLM2-135M decode throughput: jaxinfer vs transformers (CPU torch), same weights, f32.

Both load the default GGUF (dequantized to f32). Each system decodes `--new-tokens`
greedy tokens after the same prompts at batch 1 and batch 16; decode throughput is
(new tokens - 1) * batch / (time(generate N) - time(generate 1)), so prefill and the
first token are excluded alike. Both use 2 threads. Last line: one JSON object.

The same run measures this machine's limits, each in a fresh process like the systems:
read bandwidth as XLA's f32 gemv over 1 GiB of weights (four of 256 MB read in turn, in the
faster of the two forms a batch-1 step's products take), sustained over ~1 s (the read a
batch-1 decode step does), and the f32 matmul peak as XLA's [1024, 1024] x [1024, 1024]. Against them:

    b1_frac_of_bandwidth = (weight bytes + KV bytes read per token) x tok/s at b = 1 / bandwidth
    b16_frac_of_compute  = matmul FLOPs per token x tok/s at b = 16 / matmul peak

(KV read per token at the mean context of the run, prompt + new tokens / 2.)

One request on a default-sized engine (8 slots) is also timed, with its decode rows cut to
the request (`EngineConfig.decode_row_buckets`, the default) and with all 8 rows every step
(as before row buckets): `lone_on_8_slots_over_1_slot` is its tok/s over the 1-slot engine's.

    python benchmarks/decode.py [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "The history of the printing press begins in",
    "Write a short poem about the sea and the wind.",
    "Explain how a hash table handles collisions.",
    "List three facts about the planet Mars:",
]


def prompt_ids(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of exactly `length` tokens (no padding needed by either system)."""
    rows = []
    for i in range(batch):
        ids = tokenizer.encode(" ".join(PROMPTS[i % len(PROMPTS):] + PROMPTS) * 4, add_special_tokens=False)
        rows.append(ids[:length])
    return rows


def best_of(repeats: int, fn) -> float:
    return min(fn() for _ in range(repeats))


def bench_jaxinfer(model, ids: list[list[int]], new_tokens: int, repeats: int, slots: int | None = None,
                   full_rows: bool = False) -> float:
    """`slots`: the engine's max_slots (default: one per prompt); `full_rows`: decode all of
    them every step."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    b = len(ids)
    slots = slots or b
    # Every prompt prefills in one step (b rows of one chunk), then decode-only steps follow.
    engine = Engine(model, EngineConfig(max_slots=slots, max_model_len=len(ids[0]) + new_tokens,
                                        prefill_chunk=len(ids[0]), max_prefill_rows=b, enable_prefix_caching=False,
                                        decode_row_buckets=(slots,) if full_rows else None))

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        engine.generate(ids, params)
        return time.perf_counter() - t0

    run(new_tokens), run(1)  # compile both programs
    dt = best_of(repeats, lambda: run(new_tokens)) - best_of(repeats, lambda: run(1))
    return (new_tokens - 1) * b / dt


def load_hf(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def bench_hf(model, ids: list[list[int]], new_tokens: int, repeats: int) -> float:
    import torch

    inputs = torch.tensor(ids)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    run(2)
    dt = best_of(repeats, lambda: run(new_tokens)) - best_of(repeats, lambda: run(1))
    return (new_tokens - 1) * len(ids) / dt


def read_bandwidth_gbs(repeats: int = 3, reads: int = 100, weights: int = 4) -> float:
    """GB/s of XLA's f32 gemv x[1, K] @ W over `weights` distinct 256 MB weights read in turn,
    in the faster of the forms the engine's batch-1 products take (`x @ w.T` over [N, K] and
    `x @ w` over [K, N]: which is faster depends on the CPU, `jaxinfer.model.row_layouts`).
    Distinct weights, because one read again and again can sit in a large L3 (480 MB on the
    Xeon of BENCHMARKS.md's 2026-12-06 runs) and give the cache's bandwidth, where a model's
    weights (538 MB for SmolLM2-135M, 1.6 GB with the engine's extra layouts) stream from
    memory. Timed over `reads` back-to-back gemvs (~1 s, as long as a timed generate), best of
    `repeats`: a single 8 ms read sometimes catches a burst (52 GB/s once against a sustained
    30-34 on the CI machine)."""
    import jax
    import jax.numpy as jnp

    n = 256 * 2**20 // (4 * 576)
    x = jnp.ones((1, 576), jnp.float32)
    best = 0.0
    for form, shape in (("nk", (n, 576)), ("kn", (576, n))):
        ws = [jnp.full(shape, 1.0 + i, jnp.float32) for i in range(weights)]
        gemv = jax.jit((lambda x, w: x @ w.T) if form == "nk" else (lambda x, w: x @ w))
        for w in ws:
            gemv(x, w).block_until_ready()

        def run() -> float:
            t0 = time.perf_counter()
            for i in range(reads):  # one at a time: queued gemvs would overlap and share reads
                gemv(x, ws[i % weights]).block_until_ready()
            return (time.perf_counter() - t0) / reads

        best = max(best, ws[0].nbytes / best_of(repeats, run) / 1e9)
        del ws
    return best


def matmul_peak_gflops(repeats: int = 10) -> float:
    """GFLOP/s of XLA's f32 [1024, 1024] x [1024, 1024] (best of `repeats`)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((1024, 1024), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()

    def run() -> float:
        t0 = time.perf_counter()
        matmul(a).block_until_ready()
        return time.perf_counter() - t0

    return 2 * 1024**3 / best_of(repeats, run) / 1e9


def per_token_costs(model, context: float) -> tuple[float, float]:
    """(bytes read, matmul FLOPs) per decoded token at `context` cached tokens: every weight
    once plus the KV of the context; 2 FLOPs per weight of every matmul (the LM head
    included, the embedding lookup not) plus QK^T and PV over the context."""
    import jax

    c = model.config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    kv_bytes = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4 * context
    attention_weights = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)  # wq, wo, wk, wv
    matmul_weights = c.n_layers * (attention_weights + 3 * c.d_model * c.ffn_dim) + c.vocab_size * c.d_model
    return weight_bytes + kv_bytes, 2 * matmul_weights + 4 * c.n_layers * c.n_heads * c.head_dim * context


def run_system(system: str, batch: int, args: argparse.Namespace) -> float:
    """Throughput of one system at one batch size, measured in this process (or, for
    "bandwidth" / "peak", this machine's limit)."""
    if system == "bandwidth":
        return read_bandwidth_gbs()
    if system == "bandwidth_one_weight":  # one weight re-read (how bandwidth_gbs was measured before 2026-12-06)
        return read_bandwidth_gbs(weights=1)
    if system == "peak":
        return matmul_peak_gflops()
    from jaxinfer.default_model import default_model_path
    from jaxinfer.tokenizer import Tokenizer

    gguf = default_model_path()
    ids = prompt_ids(Tokenizer.from_gguf(gguf), batch, args.prompt_tokens)
    if system == "hf":
        return bench_hf(load_hf(gguf), ids, args.new_tokens, args.repeats)
    from jaxinfer.loading import load_model

    slots = {"jaxinfer": None, "jaxinfer_8_slots": 8, "jaxinfer_8_slots_full_rows": 8}[system]
    return bench_jaxinfer(load_model(gguf), ids, args.new_tokens, args.repeats, slots, system.endswith("full_rows"))


def in_subprocess(system: str, batch: int, args: argparse.Namespace) -> float:
    """Each measurement in a fresh process, so neither runtime's idle threads (XLA's pool,
    torch's OpenMP) compete with the other's."""
    cmd = [sys.executable, __file__, "--only", f"{system}:{batch}", "--new-tokens", str(args.new_tokens),
           "--prompt-tokens", str(args.prompt_tokens), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", help=argparse.SUPPRESS)  # "system:batch", used by in_subprocess
    args = parser.parse_args()
    if args.only:
        system, batch = args.only.split(":")
        print(run_system(system, int(batch), args))
        return

    results = {"load_before": round(os.getloadavg()[0], 2)}
    bandwidth, peak = in_subprocess("bandwidth", 0, args), in_subprocess("peak", 0, args)
    one_weight = in_subprocess("bandwidth_one_weight", 0, args)
    print(f"read bandwidth {bandwidth:.1f} GB/s (gemv over 1 GiB; {one_weight:.1f} re-reading one 256 MB weight), "
          f"matmul peak {peak:.0f} GFLOP/s", flush=True)
    tok_s = {}
    for b in (1, 16):
        jx = in_subprocess("jaxinfer", b, args)
        hf = in_subprocess("hf", b, args)
        print(f"batch {b:2d}: jaxinfer {jx:7.1f} tok/s   transformers {hf:7.1f} tok/s   ratio {jx / hf:.2f}", flush=True)
        results |= {f"jaxinfer_tok_s_b{b}": round(jx, 1), f"hf_tok_s_b{b}": round(hf, 1), f"ratio_b{b}": round(jx / hf, 2)}
        tok_s[b] = jx
    lone = {rows: in_subprocess(f"jaxinfer_8_slots{rows}", 1, args) for rows in ("", "_full_rows")}
    print(f"one request on 8 slots: {lone['']:.1f} tok/s with row buckets, {lone['_full_rows']:.1f} with all 8 rows",
          flush=True)
    results |= {"lone_on_8_slots_tok_s": round(lone[""], 1), "lone_on_8_slots_full_rows_tok_s": round(lone["_full_rows"], 1),
                "lone_on_8_slots_over_1_slot": round(lone[""] / tok_s[1], 3),
                "lone_full_rows_over_1_slot": round(lone["_full_rows"] / tok_s[1], 3)}
    from jaxinfer.default_model import default_model_path
    from jaxinfer.loading import load_model

    token_bytes, token_flops = per_token_costs(load_model(default_model_path(), progress=False),
                                               args.prompt_tokens + args.new_tokens / 2)
    results |= {"bandwidth_gbs": round(bandwidth, 1), "one_weight_bandwidth_gbs": round(one_weight, 1),
                "matmul_peak_gflops": round(peak, 1),
                "b1_frac_of_bandwidth": round(token_bytes * tok_s[1] / (bandwidth * 1e9), 3),
                "b16_frac_of_compute": round(token_flops * tok_s[16] / (peak * 1e9), 3)}
    print(f"# {platform.machine()}, {os.cpu_count()} cpus, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, f32, greedy, torch threads 2")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
