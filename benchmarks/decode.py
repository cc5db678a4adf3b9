"""SmolLM2-135M decode throughput: jaxinfer vs transformers (CPU torch), same weights, f32.

Both load the default GGUF (dequantized to f32). Each system decodes `--new-tokens`
greedy tokens after the same prompts at batch 1 and batch 16; decode throughput is
(new tokens - 1) * batch / (time(generate N) - time(generate 1)), so prefill and the
first token are excluded alike. Both use 2 threads. Last line: one JSON object.

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


def bench_jaxinfer(model, ids: list[list[int]], new_tokens: int, repeats: int) -> float:
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.sampling import SamplingParams

    b = len(ids)
    # Every prompt prefills in one step (b rows of one chunk), then decode-only steps follow.
    engine = Engine(model, EngineConfig(max_slots=b, max_model_len=len(ids[0]) + new_tokens, prefill_chunk=len(ids[0]),
                                        max_prefill_rows=b, enable_prefix_caching=False))

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


def run_system(system: str, batch: int, args: argparse.Namespace) -> float:
    """Throughput of one system at one batch size, measured in this process."""
    from jaxinfer.default_model import default_model_path
    from jaxinfer.tokenizer import Tokenizer

    gguf = default_model_path()
    ids = prompt_ids(Tokenizer.from_gguf(gguf), batch, args.prompt_tokens)
    if system == "hf":
        return bench_hf(load_hf(gguf), ids, args.new_tokens, args.repeats)
    from jaxinfer.loading import load_model

    return bench_jaxinfer(load_model(gguf), ids, args.new_tokens, args.repeats)


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

    results = {}
    for b in (1, 16):
        jx = in_subprocess("jaxinfer", b, args)
        hf = in_subprocess("hf", b, args)
        print(f"batch {b:2d}: jaxinfer {jx:7.1f} tok/s   transformers {hf:7.1f} tok/s   ratio {jx / hf:.2f}", flush=True)
        results |= {f"jaxinfer_tok_s_b{b}": round(jx, 1), f"hf_tok_s_b{b}": round(hf, 1), f"ratio_b{b}": round(jx / hf, 2)}
    print(f"# {platform.machine()}, {os.cpu_count()} cpus, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, f32, greedy, torch threads 2")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
