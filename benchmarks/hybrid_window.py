"""Gemma 3 270M (GGUF Q4_K_M): parity with transformers, KV memory per layer type, decode speed.

    gemma3_logit_maxdiff_vs_hf   max |logit difference| vs transformers on the same dequantized
                                 weights (f32), every position of three real prompts
    kv_bytes_ratio_8k / _32k     KV bytes one sequence holds in the engine's pools at 8k / 32k
                                 tokens, over what it would hold with every layer keeping every
                                 page. Measured from the pools (`Engine.request_kv_bytes`) after
                                 running a request that far, in an engine with Gemma 3 270M's KV
                                 geometry (18 layers, 5 windowed of 512 tokens per global one,
                                 1 KV head of 256) and tiny other widths, so 32k tokens prefill
                                 in a minute on CPU; the denominator is a global layer's measured
                                 bytes times the layer count.
    prefix_saved_frac_16k        a shared-system-prompt trace (16k-token system prompt, 4 requests,
                                 the first alone) on that geometry with window rings and prefix
                                 caching: prompt tokens the cache spared / all prompt tokens;
                                 a hit still recomputes 15 x 511 tokens for the rings
                                 (`jaxinfer.kv.window_ring.hit_recompute`)
    tok_s_b1 / tok_s_b16         jaxinfer decode throughput (the real model, `decode.py`'s method)
    hf_tok_s_b1                  transformers (CPU torch, 2 threads) on the same weights

Last line: one JSON object.

    python benchmarks/hybrid_window.py [--new-tokens 32] [--repeats 2] [--skip-speed]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from decode import bench_hf, bench_jaxinfer, load_hf, prompt_ids

PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis is the process by which green plants",
]


def gemma3_gguf():
    from jaxinfer.default_model import packaged_model_path

    return packaged_model_path("gemma3-270m")


def logit_maxdiff() -> float:
    import jax.numpy as jnp
    import numpy as np
    import torch

    from jaxinfer.kv import KVCacheSpec, init_paged_kv
    from jaxinfer.loading import load_model
    from jaxinfer.model import forward

    gguf = gemma3_gguf()
    ours, hf = load_model(gguf), load_hf(gguf)
    worst = 0.0
    for prompt in PARITY_PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        spec = KVCacheSpec.for_batch(1, len(ids), page_size=16)
        kv = init_paged_kv(ours.config, spec)
        kv = kv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32)[None])
        logits, _ = forward(ours.params, ours.config, jnp.asarray([ids]), jnp.arange(len(ids))[None], kv)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits.numpy()
        worst = max(worst, float(np.abs(np.asarray(logits) - want).max()))
    return worst


def gemma3_geometry():
    """A random model with Gemma 3 270M's KV geometry (18 layers, 5 windowed of 512 per global
    one, 1 KV head of 256) and tiny other widths."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.loading import Model
    from jaxinfer.model import init_random_params

    config = ModelConfig(arch="gemma3", vocab_size=256, d_model=64, n_layers=18, n_heads=1, n_kv_heads=1, head_dim=256,
                         ffn_dim=64, rope_theta=1e6, rope_local_theta=1e4, query_scale=1 / 16, max_position=32768,
                         tie_embeddings=True, layer_windows=((512,) * 5 + (None,)) * 3)
    return Model(config, init_random_params(config), tokenizer=None)


def kv_bytes_ratios(contexts: tuple[int, ...], prefill_chunk: int = 256) -> dict[int, float]:
    """Run one request to each context length; KV bytes it holds / every layer holding every page."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    model = gemma3_geometry()
    config = model.config
    ratios = {}
    for n in contexts:
        eng = Engine(model, EngineConfig(max_slots=1, page_size=16, prefill_chunk=prefill_chunk, max_model_len=n,
                                         enable_prefix_caching=False))
        # the prompt fills the context but for the 2 tokens it will generate (it is measured after the first)
        rid = eng.add_request([i % 256 for i in range(n - 2)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        req = eng.requests[rid]
        while req.num_computed < n - 2:
            eng.step()
        held = eng.request_kv_bytes(rid)
        global_layer = next(i for i in range(config.n_layers) if config.window(i) is None)
        one_layer = eng.kv.layers[global_layer]
        full = config.n_layers * sum(a.nbytes for a in (one_layer.k, one_layer.v)) * len(req.pages) // eng.spec.num_pages
        ratios[n] = held / full
        print(f"{n:6d} tokens: {held / 2**20:7.1f} MiB held, {full / 2**20:7.1f} MiB with every layer full "
              f"(ratio {held / full:.3f}, ring {eng.window_ring} pages)", flush=True)
    return ratios


def prefix_saving(system_tokens: int, users: int = 4, user_tokens: int = 32) -> dict:
    """A shared-system-prompt trace on the Gemma 3 geometry with window rings: one request, then
    `users - 1` more at once, each the same system prompt + its own user tokens. -> the prompt
    tokens the prefix cache spared the model per hit and over the trace (measured from the
    requests' metrics), and the tokens a hit still recomputes for the rings."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    eng = Engine(gemma3_geometry(), EngineConfig(max_slots=4, page_size=16, prefill_chunk=256,
                                                 max_model_len=system_tokens + user_tokens + 16))
    system = [i * 7 % 256 for i in range(system_tokens)]
    prompts = [system + [(u * 31 + j) % 256 for j in range(user_tokens)] for u in range(users)]
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    outs = eng.generate(prompts[:1], once) + eng.generate(prompts[1:], once)
    saved = [o.metrics.num_cached_prompt_tokens for o in outs]
    total = sum(len(p) for p in prompts)
    print(f"system prompt {system_tokens} tokens, {users} requests: saved per hit {saved[1:]}, recompute "
          f"{eng.scheduler.hit_recompute}, prompt tokens computed {total - sum(saved)} of {total}", flush=True)
    return {"system_tokens": system_tokens, "saved_per_hit": saved[1], "hit_recompute": eng.scheduler.hit_recompute,
            "prefill_saved_frac": round(sum(saved) / total, 4)}


def run_speed(system: str, batch: int, args: argparse.Namespace) -> float:
    from jaxinfer.tokenizer import Tokenizer

    gguf = gemma3_gguf()
    ids = prompt_ids(Tokenizer.from_gguf(gguf), batch, args.prompt_tokens)
    if system == "hf":
        return bench_hf(load_hf(gguf), ids, args.new_tokens, args.repeats)
    from jaxinfer.loading import load_model

    return bench_jaxinfer(load_model(gguf), ids, args.new_tokens, args.repeats)


def in_subprocess(only: str, args: argparse.Namespace) -> float:
    """Each measurement in a fresh process, so neither runtime's idle threads compete."""
    cmd = [sys.executable, __file__, "--only", only, "--new-tokens", str(args.new_tokens),
           "--prompt-tokens", str(args.prompt_tokens), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-speed", action="store_true", help="parity and KV bytes only")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # "parity", "prefix" or "system:batch" (in_subprocess)
    args = parser.parse_args()
    if args.only == "parity":
        print(logit_maxdiff())
        return
    if args.only == "prefix":
        print(json.dumps(prefix_saving(16384)))
        return
    if args.only:
        system, batch = args.only.split(":")
        print(run_speed(system, int(batch), args))
        return

    start = time.perf_counter()
    results = {"gemma3_logit_maxdiff_vs_hf": in_subprocess("parity", args)}
    print(f"logits vs transformers: max |diff| {results['gemma3_logit_maxdiff_vs_hf']:.2e}", flush=True)
    ratios = kv_bytes_ratios((8192, 32768))
    results |= {"kv_bytes_ratio_8k": round(ratios[8192], 4), "kv_bytes_ratio_32k": round(ratios[32768], 4)}
    results["prefix_saved_frac_16k"] = prefix_saving(16384)["prefill_saved_frac"]
    if not args.skip_speed:
        for key, only in (("tok_s_b1", "jaxinfer:1"), ("tok_s_b16", "jaxinfer:16"), ("hf_tok_s_b1", "hf:1")):
            results[key] = round(in_subprocess(only, args), 1)
            print(f"{key}: {results[key]} tok/s", flush=True)
    print(f"# {platform.machine()}, {os.cpu_count()} cpus, prompt {args.prompt_tokens} tokens, {args.new_tokens} new "
          f"tokens, f32, greedy; {time.perf_counter() - start:.0f} s")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
