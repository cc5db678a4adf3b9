"""What structured output costs a decode step: SmolLM2-135M, f32, greedy.

One engine per batch size (1 and 8) decodes the same prompts plain and with every request
constrained to a JSON schema (an object with a free "story" string: the grammar stays open,
so the requests decode as long as the plain ones), the two alternating; decode tok/s =
(tokens(N) - tokens(1)) / (time(N) - time(1)), best of `--repeats`. A constrained step adds
the host's llguidance mask (per request: `GrammarMatcher.allowed`, then `consume` of the
sampled token) and the device's `mask_logits` over [rows, 49,152] to the plain step; the
grammar's mask and consume are also timed alone over the tokens the constrained run produced.

Then JSON that copies its input (names, items, fields extracted from the prompt into a
schema), one request at a time: constrained greedy decoding plain and with n-gram speculation
(k = 4; the host keeps the drafts the grammar allows and sends the mask after each), the same
tokens both ways (checked), alternating runs, best of `--repeats`.

    python benchmarks/structured_output.py [--new-tokens 48] [--repeats 3]

Last line, JSON: `plain_tok_s_b{1,8}`, `json_tok_s_b{1,8}`, `json_over_plain_b{1,8}`,
`mask_ms_per_token` (host: one mask and one consume), `copy_json_tok_s_{plain,ngram}`,
`copy_json_ngram_speedup`, `copy_json_tokens_per_call`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np

from jaxinfer.default_model import default_model_path
from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import load_model
from jaxinfer.sampling import SamplingParams
from jaxinfer.structured_output import GrammarCompiler, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
          "required": ["title", "story"], "additionalProperties": False}
PROMPTS = ["Write a long story about the sea, as JSON.", "Tell a long tale of a dragon and a knight, as JSON.",
           "Describe a long journey across the desert, as JSON.", "Write a long fable about a fox, as JSON."]
# JSON whose values come from the prompt: where prompt lookup has something to find
COPY_TASKS = [
    ("Extract all the person names from this text as JSON: Maria met John and Aiko at the station, and later "
     "they had lunch with Peter, Fatima and Carlos near the old bridge.",
     {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}}}, "required": ["names"]}),
    ("List the items of this sentence as JSON: For the trip we need a tent, two sleeping bags, a camping stove, "
     "a water filter, a first aid kit and a map.",
     {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}, "required": ["items"]}),
    ("Return this contact as JSON with name, email and city: Dr. Helena Marquez, helena.marquez@example.org, "
     "lives in Valparaiso.",
     {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                       "city": {"type": "string"}}, "required": ["name", "email", "city"]}),
    ("Convert to JSON with keys name, ip and ports: server-01 has address 10.0.0.5 and listens on ports 22, 80 "
     "and 443.",
     {"type": "object", "properties": {"name": {"type": "string"}, "ip": {"type": "string"},
                                       "ports": {"type": "array", "items": {"type": "integer"}}},
      "required": ["name", "ip", "ports"]}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    model = load_model(default_model_path())
    tok = model.tokenizer
    plain = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    constrained = dataclasses.replace(plain, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    result: dict[str, float] = {"load_before": round(load, 2)}
    outputs = []
    for b in (1, 8):
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]),
                          add_special_tokens=False) for i in range(b)]
        engine = Engine(model, EngineConfig(max_slots=b, max_model_len=256, enable_prefix_caching=False))

        def run(params: SamplingParams, n: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            outs = engine.generate(ids, dataclasses.replace(params, max_tokens=n))
            outputs.extend(o.token_ids for o in outs if params.structured_outputs is not None)
            return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)

        pair = (("plain", plain), ("json", constrained))
        for _, params in pair:  # compile every program both need
            run(params, args.new_tokens), run(params, 1)
        rates: dict[str, list[float]] = {"plain": [], "json": []}
        for _ in range(args.repeats):
            for name, params in pair:
                (long, n_long), (short, n_short) = run(params, args.new_tokens), run(params, 1)
                rates[name].append((n_long - n_short) / (long - short))
        for name, values in rates.items():
            result[f"{name}_tok_s_b{b}"] = round(max(values), 1)
        result[f"json_over_plain_b{b}"] = round(result[f"json_tok_s_b{b}"] / result[f"plain_tok_s_b{b}"], 3)
        print(f"b={b}: plain {result[f'plain_tok_s_b{b}']} tok/s, json {result[f'json_tok_s_b{b}']} tok/s", flush=True)

    result.update(copy_json(model, args.repeats))

    compiler = GrammarCompiler(tok, model.config.vocab_size, model.config.eos_ids)
    samples = []
    for tokens in outputs[-8:]:
        matcher = compiler.matcher(constrained.structured_outputs)
        for token in tokens:
            t0 = time.perf_counter()
            matcher.allowed()
            matcher.consume(token)
            samples.append(time.perf_counter() - t0)
    result["mask_ms_per_token"] = round(1e3 * float(np.median(samples)), 3)
    print(json.dumps(result))


def copy_json(model, repeats: int) -> dict[str, float]:
    """`COPY_TASKS` one at a time, constrained greedy, plain vs n-gram speculation (k = 4)."""
    from jaxinfer.engine import SpeculativeConfig

    tok = model.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p, _ in COPY_TASKS]
    params = [SamplingParams(temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=schema))
              for _, schema in COPY_TASKS]
    engines = {name: Engine(model, EngineConfig(max_slots=1, max_model_len=512, enable_prefix_caching=False,
                                                speculative=spec))
               for name, spec in (("plain", None), ("ngram", SpeculativeConfig("ngram", 4)))}

    def run(engine: Engine) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = [engine.generate([i], p)[0].token_ids for i, p in zip(ids, params)]
        return time.perf_counter() - t0, outs

    answers = {name: run(engine)[1] for name, engine in engines.items()}  # compiles what each needs
    assert answers["ngram"] == answers["plain"], "speculation changed a greedy constrained answer"
    before = engines["ngram"].metrics().speculative
    best = {name: min(run(engine)[0] for _ in range(repeats)) for name, engine in engines.items()}
    after = engines["ngram"].metrics().speculative
    tokens = sum(map(len, answers["plain"]))
    rates = {name: tokens / t for name, t in best.items()}
    print(f"copy JSON, b=1: plain {rates['plain']:.1f} tok/s, n-gram {rates['ngram']:.1f} tok/s", flush=True)
    return {"copy_json_tok_s_plain": round(rates["plain"], 1), "copy_json_tok_s_ngram": round(rates["ngram"], 1),
            "copy_json_ngram_speedup": round(rates["ngram"] / rates["plain"], 3),
            "copy_json_tokens_per_call": round((after.emitted - before.emitted) / (after.target_calls - before.target_calls), 3)}


if __name__ == "__main__":
    main()
