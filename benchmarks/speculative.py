"""Speculative decoding on SmolLM2-135M (f32, CPU): speedup over the same engine without it.

    python benchmarks/speculative.py [--new-tokens 96] [--quick]

For each draft source (n-gram prompt lookup, self-speculation over the first 8 layers,
the trained draft in checkpoints/smollm2_draft) and k in {2, 4}, at temperature 0 and 1:
  b1  the first 4 prompts one at a time through an engine with max_slots=1
  b8  all 8 prompts at once through an engine with max_slots=8
against the same engine with speculation off, in the same run. Speedup = generated tokens
per second over the baseline's; tokens per call = tokens a decoding slot emits per target
forward. The baselines run before and after the speculative runs and the speedup divides
by their mean (the machine's load drifts). Chat prompts, half of them asking to rewrite or continue text they contain (where
n-gram lookup has something to find), half open questions; generation stops at EOS or
--new-tokens. Temperature 1 runs use fixed seeds; their outputs differ from the baseline's
(only the distribution is the same), so their token counts differ too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

PROMPTS = [
    "Rewrite this sentence in the past tense: I walk to the market, I buy some apples and I go home to cook dinner.",
    "Fix the spelling in this text and write it out again: The quik brown fox jumpd over the lazzy dog near the rivr bank.",
    "Convert this list to a numbered list: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Here is a function:\ndef add(a, b):\n    return a + b\nRewrite it with type hints and a docstring.",
    "Explain why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are three benefits of regular exercise?",
    "Describe how a bicycle works.",
]
SOURCES = ("ngram", "self:8", "draft")


def engine_for(model, slots: int, speculative):
    from jaxinfer.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(max_slots=slots, page_size=32, max_model_len=256, prefill_chunk=128,
                                      enable_prefix_caching=False, speculative=speculative))


def run(model, batch: int, temperature: float, speculative, new_tokens: int) -> dict:
    """Generated tokens per second (after a warm-up request) and tokens per target call."""
    from jaxinfer.sampling import SamplingParams

    engine = engine_for(model, batch, speculative)
    params = [SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=i) for i in range(len(PROMPTS))]
    engine.warmup()  # compile every program (context buckets, block widths) before timing
    stats_before = engine.metrics().speculative
    t0 = time.perf_counter()
    if batch == 1:
        outs = [engine.generate([p], sp, chat=True)[0] for p, sp in zip(PROMPTS[:4], params)]
    else:
        outs = engine.generate(PROMPTS[:batch], params[:batch], chat=True)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    result = {"tok_s": tokens / dt, "tokens": tokens}
    if speculative is not None:
        s = engine.metrics().speculative
        calls = s.target_calls - stats_before.target_calls
        result["tokens_per_call"] = (s.emitted - stats_before.emitted) / max(calls, 1)
        drafted = s.drafted - stats_before.drafted
        result["acceptance_per_position"] = [round(float(a / d), 3) if d else None
                                             for a, d in zip(s.accepted - stats_before.accepted, drafted)]
    return result


def config_for(source: str, k: int):
    from jaxinfer.engine import SpeculativeConfig

    return SpeculativeConfig.parse(source, num_speculative=k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true", help="k=4 and temperature 0 only")
    parser.add_argument("--sources", default=",".join(SOURCES), help="comma-separated draft sources")
    args = parser.parse_args()

    from jaxinfer.loading import load_model

    model = load_model(progress=False)
    ks = (4,) if args.quick else (2, 4)
    temps = (0.0,) if args.quick else (0.0, 1.0)
    before = {(b, t): run(model, b, t, None, args.new_tokens) for b in (1, 8) for t in temps}
    for (b, t), r in before.items():
        print(f"baseline b{b} t{t:g}: {r['tok_s']:.1f} tok/s ({r['tokens']} tokens)", flush=True)
    runs = {}
    for source in args.sources.split(","):
        for k in ks:
            for b in (1, 8):
                for t in temps:
                    r = runs[source, k, b, t] = run(model, b, t, config_for(source, k), args.new_tokens)
                    print(f"{source}_k{k} b{b} t{t:g}: {r['tok_s']:.1f} tok/s, {r['tokens_per_call']:.2f} tokens/call, "
                          f"acceptance {r['acceptance_per_position']}", flush=True)
    # The baseline again at the end: the speedup divides by the mean of both baselines, so a
    # change in machine load during the run (a shared machine) biases no draft source.
    after = {(b, t): run(model, b, t, None, args.new_tokens) for b in (1, 8) for t in temps}
    base = {key: (before[key]["tok_s"] + after[key]["tok_s"]) / 2 for key in before}
    for key in before:
        print(f"baseline b{key[0]} t{key[1]:g}: before {before[key]['tok_s']:.1f}, after {after[key]['tok_s']:.1f} tok/s")
    per_draft = {}
    for (source, k, b, t), r in runs.items():
        speedup = r["tok_s"] / base[b, t]
        per_draft.setdefault(f"{source}_k{k}", {})[f"b{b}_t{t:g}"] = {
            "speedup": round(speedup, 3), "tokens_per_call": round(r["tokens_per_call"], 3),
            "acceptance_per_position": r["acceptance_per_position"]}
        print(f"{source}_k{k} b{b} t{t:g}: speedup {speedup:.2f}")
    best = max(per_draft, key=lambda n: per_draft[n]["b1_t0"]["speedup"])
    print(f"# {platform.machine()}, {os.cpu_count()} cpus, f32, SmolLM2-135M, {args.new_tokens} new tokens max")
    print(json.dumps({
        "best_draft": best,
        "best_speedup_b1": per_draft[best]["b1_t0"]["speedup"],
        "best_tokens_per_call_b1": per_draft[best]["b1_t0"]["tokens_per_call"],
        "best_speedup_b8": max(e["b8_t0"]["speedup"] for e in per_draft.values()),
        "per_draft": per_draft,
    }))


if __name__ == "__main__":
    main()
