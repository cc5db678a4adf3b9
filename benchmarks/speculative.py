"""Speculative decoding on SmolLM2-135M (f32, CPU): speedup over the same engine without it.

    python benchmarks/speculative.py [--new-tokens 96] [--sources ngram,draft,eagle] [--full]

Two prompt sets, chat template on: CHAT_PROMPTS (open questions, nothing to copy) and
COPY_PROMPTS (answers that copy their input: rewrite, fix, convert, annotate code, extract,
quote). Draft sources: n-gram prompt lookup, the trained draft (checkpoints/smollm2_draft), the
EAGLE head (checkpoints/smollm2_eagle) and, with --full, self-speculation over the first 8
layers; a source whose
`SpeculativeConfig.parse` (or engine) fails here is skipped with a note.

Default runs, all greedy (temperature 0):
  b1  4 chat / all 8 copy prompts one at a time (max_slots=1), for every source at
      k in {2, 4} on both sets (n-gram also k=8 on the copy set)
  b8  the 8 chat prompts at once (max_slots=8), per source at its best b1 chat k
  1of8  the b1 chat prompts one at a time on that 8-slot engine (a lone user of a server:
      its decode-only steps verify one row, `EngineConfig.decode_row_buckets`)
against the same engines with speculation off, run before and after all speculative runs
(the speedup divides by their mean: the machine's load drifts). `--full` adds temperature 1
(fixed seeds) and b8 for every k. Speedup = generated tokens per second over the baseline's;
tokens per call = tokens a decoding slot emits per target forward. Per-run lines, then a
last-line JSON (`per_draft`/best_* keys: chat set; `copy_*`: copy set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

# Open questions: nothing in the prompt for the answer to copy (and none of them in the
# draft's training prompts, jaxinfer.speculative.train.prompts).
CHAT_PROMPTS = [
    "Why do cats purr?",
    "What makes a good team leader?",
    "How do airplanes stay in the air?",
    "What are some good habits for learning to play the guitar?",
    "How does a refrigerator keep food cold without any ice?",
    "What would happen if the moon disappeared?",
    "Describe the taste of a ripe mango to someone who has never eaten one.",
    "What are the pros and cons of living in a big city?",
]
# Answers that copy their input: where prompt lookup has something to find.
COPY_PROMPTS = [
    "Rewrite this paragraph in the past tense: Every morning I open the shop, sweep the floor and put fresh "
    "flowers in the window. Customers come in, ask about prices and usually buy a small bouquet.",
    "Add type hints to this Python function and return the whole function:\n"
    "def scale(values, factor):\n    result = []\n    for value in values:\n        result.append(value * factor)\n"
    "    return result",
    "Fix the spelling mistakes in this text and write it out again: Yesterday the techer gave us a dificult "
    "asignment about the histroy of the anceint Greeks, and evryone was suprised.",
    "Convert this sentence into a numbered list of items: For the trip we need a tent, two sleeping bags, a "
    "camping stove, a water filter, a first aid kit and a map.",
    "Extract all the person names from this text, one per line: Maria met John and Aiko at the station, and "
    "later they had lunch with Peter, Fatima and Carlos near the old bridge.",
    "Summarize this text in two sentences, quoting its most important sentence exactly: The city council voted "
    "on Tuesday to build a new library in the town centre. 'This library will be open to everyone, every day of "
    "the week,' said the mayor. Construction starts next spring and should take two years.",
    "Rewrite this email so it is more polite, keeping all the details: Send me the sales figures for March by "
    "Friday. I need the totals per region and the names of the top three sellers.",
    'Convert this JSON to YAML:\n{"name": "server-01", "ip": "10.0.0.5", "ports": [22, 80, 443], "active": true}',
]
PROMPT_SETS = {"chat": CHAT_PROMPTS, "copy": COPY_PROMPTS}
SOURCES = ("ngram", "draft", "eagle")  # default; --full adds self:8 (0.3-0.5x in every run so far)
FULL_SOURCES = ("ngram", "self:8", "draft", "eagle")
# b1 runs one request at a time: 4 chat prompts keep the run short; copy answers are short, all 8 run
B1_PROMPTS = {"chat": 4, "copy": 8}


def engine_for(model, slots: int, speculative):
    """An engine with every program compiled (context buckets, block widths) before timing."""
    from jaxinfer.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(max_slots=slots, page_size=32, max_model_len=256, prefill_chunk=128,
                                        enable_prefix_caching=False, speculative=speculative))
    engine.warmup()
    return engine


def run(engine, set_name: str, batch: int, temperature: float, new_tokens: int) -> dict:
    """Generated tokens per second and (speculating) tokens per target call, acceptance."""
    from jaxinfer.sampling import SamplingParams

    prompts = PROMPT_SETS[set_name]
    params = [SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=i) for i in range(len(prompts))]
    stats_before = engine.metrics().speculative
    t0 = time.perf_counter()
    if batch == 1:
        outs = [engine.generate([p], sp, chat=True)[0] for p, sp in zip(prompts[: B1_PROMPTS[set_name]], params)]
    else:
        outs = engine.generate(prompts[:batch], params[:batch], chat=True)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    result = {"tok_s": tokens / dt, "tokens": tokens}
    if stats_before is not None:
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


def ks_for(source: str, prompt_set: str) -> tuple[int, ...]:
    # long n-gram drafts only pay where the answer copies long runs of its input
    return (2, 4, 8) if source == "ngram" and prompt_set == "copy" else (2, 4)


def print_run(name: str, r: dict) -> None:
    line = f"{name}: {r['tok_s']:.1f} tok/s ({r['tokens']} tokens)"
    if "tokens_per_call" in r:
        line += f", {r['tokens_per_call']:.2f} tokens/call, acceptance {r['acceptance_per_position']}"
    print(line, flush=True)


def baselines(engines: dict, temps: tuple[float, ...], new_tokens: int, when: str) -> dict:
    """(set, batch, temperature) -> run, with speculation off."""
    out = {}
    for (set_name, b, t) in ([(s, 1, t) for s in PROMPT_SETS for t in temps] + [("chat", 8, t) for t in temps]
                             + [("chat", "1of8", t) for t in temps]):
        r = out[set_name, b, t] = run(engines[8 if b == "1of8" else b], set_name, 1 if b == "1of8" else b, t,
                                      new_tokens)
        print_run(f"baseline {when} {set_name} b{b} t{t:g}", r)
    return out


def speculative_runs(model, source: str, temps: tuple[float, ...], full: bool, new_tokens: int) -> dict:
    """(set, k, batch, temperature) -> run for one draft source; {} if it cannot run here."""
    runs = {}
    for k in sorted(set(ks_for(source, "chat")) | set(ks_for(source, "copy"))):
        try:
            engine = engine_for(model, 1, config_for(source, k))
        except Exception as e:  # a source not available in this checkout (e.g. no EAGLE head yet)
            print(f"# skipping {source}: {type(e).__name__}: {e}", flush=True)
            return {}
        for set_name in PROMPT_SETS:
            if k in ks_for(source, set_name):
                for t in temps:
                    r = runs[set_name, k, 1, t] = run(engine, set_name, 1, t, new_tokens)
                    print_run(f"{source}_k{k} {set_name} b1 t{t:g}", r)
        del engine
    best_k = max(ks_for(source, "chat"), key=lambda k: runs["chat", k, 1, 0.0]["tok_s"])
    for k in ks_for(source, "chat") if full else (best_k,):
        engine = engine_for(model, 8, config_for(source, k))
        for t in temps:
            r = runs["chat", k, 8, t] = run(engine, "chat", 8, t, new_tokens)
            print_run(f"{source}_k{k} chat b8 t{t:g}", r)
            r = runs["chat", k, "1of8", t] = run(engine, "chat", 1, t, new_tokens)
            print_run(f"{source}_k{k} chat b1of8 t{t:g}", r)
        del engine
    return runs


def verify_cost(model):
    """verify k=4 / plain step time at b1 from benchmarks/verify_profile.py, when it exists."""
    try:
        from verify_profile import measure_verify_cost
    except ImportError:
        print("# verify_cost_k4_b1: benchmarks/verify_profile.py not here, left null", flush=True)
        return None
    return round(float(measure_verify_cost(model, 4, 1)), 3)


def summarize(runs: dict, base: dict, set_name: str) -> dict:
    """per_draft for one prompt set: {source_k: {b1_t0: {speedup, tokens_per_call, acceptance}}}."""
    per_draft = {}
    for (source, s, k, b, t), r in runs.items():
        if s == set_name:
            speedup = r["tok_s"] / base[s, b, t]
            per_draft.setdefault(f"{source}_k{k}", {})[f"b{b}_t{t:g}"] = {
                "speedup": round(speedup, 3), "tokens_per_call": round(r["tokens_per_call"], 3),
                "acceptance_per_position": r["acceptance_per_position"]}
            print(f"{source}_k{k} {s} b{b} t{t:g}: speedup {speedup:.2f}, {r['tokens_per_call']:.2f} tokens/call")
    return per_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--full", action="store_true", help="also temperature 1, and b8 for every k")
    parser.add_argument("--sources", help=f"comma-separated draft sources (default {','.join(SOURCES)}; "
                        f"with --full {','.join(FULL_SOURCES)})")
    args = parser.parse_args()
    sources = args.sources.split(",") if args.sources else list(FULL_SOURCES if args.full else SOURCES)

    from jaxinfer.loading import load_model

    model = load_model(progress=False)
    temps = (0.0, 1.0) if args.full else (0.0,)
    plain = {b: engine_for(model, b, None) for b in (1, 8)}
    before = baselines(plain, temps, args.new_tokens, "before")
    runs = {}
    for source in sources:
        for (s, k, b, t), r in speculative_runs(model, source, temps, args.full, args.new_tokens).items():
            runs[source, s, k, b, t] = r
    # The baseline again at the end: the speedup divides by the mean of both baselines, so a
    # change in machine load during the run (a shared machine) biases no draft source.
    after = baselines(plain, temps, args.new_tokens, "after")
    base = {key: (before[key]["tok_s"] + after[key]["tok_s"]) / 2 for key in before}
    cost = verify_cost(model)
    per_draft, copy_per_draft = summarize(runs, base, "chat"), summarize(runs, base, "copy")
    best = max(per_draft, key=lambda n: per_draft[n]["b1_t0"]["speedup"])
    copy_best = max(copy_per_draft, key=lambda n: copy_per_draft[n]["b1_t0"]["speedup"])
    print(f"# {platform.machine()}, {os.cpu_count()} cpus, f32, SmolLM2-135M, {args.new_tokens} new tokens max, "
          f"best on copy prompts: {copy_best}")
    print(json.dumps({
        "best_draft": best,
        "best_speedup_b1": per_draft[best]["b1_t0"]["speedup"],
        "best_tokens_per_call_b1": per_draft[best]["b1_t0"]["tokens_per_call"],
        "best_speedup_b8": max(e["b8_t0"]["speedup"] for e in per_draft.values() if "b8_t0" in e),
        # the best b1 draft, one request at a time on an 8-slot engine, over plain decoding there
        "best_speedup_1of8": per_draft[best].get("b1of8_t0", {}).get("speedup"),
        "copy_best_draft": copy_best,
        "copy_best_speedup_b1": copy_per_draft[copy_best]["b1_t0"]["speedup"],
        "verify_cost_k4_b1": cost,
        "eagle": {f"{name} {set_name}": v["b1_t0"] for set_name, table in (("chat", per_draft), ("copy", copy_per_draft))
                  for name, v in table.items() if name.startswith("eagle")},
        "per_draft": per_draft,
        "copy_per_draft": copy_per_draft,
    }))


if __name__ == "__main__":
    main()
