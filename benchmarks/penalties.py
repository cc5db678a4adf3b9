"""What penalties and logit bias cost a decode step: SmolLM2-135M, f32, greedy.

One engine per batch size (1 and 8) decodes the same prompts plain and with every request
penalized (repetition 1.1, frequency 0.3, presence 0.2 and a 16-token logit bias), the two
alternating; decode tok/s = (new tokens - 1) x batch / (time(N tokens) - time(1 token)), best
of `--repeats`. Penalized steps add `count_fed` and `penalize` over [rows, 49,152] to the
plain step (`jaxinfer.penalties`); each admission writes one slot's row. A third engine
speculates with n-gram drafts (k = 4) on one copy-style request, plain and with a bias and
min_tokens that change no token: the cost of penalized verify blocks.

    python benchmarks/penalties.py [--new-tokens 48] [--repeats 3]

Last line, JSON: `plain_tok_s_b{1,8}`, `penalized_tok_s_b{1,8}`, `penalized_over_plain_b{1,8}`,
the same three with an `ngram_` prefix at b1, `set_slot_ms` (one admission's row write).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import numpy as np

from jaxinfer.default_model import default_model_path
from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.loading import load_model
from jaxinfer.penalties import init_penalty_state, set_slot, slot_history
from jaxinfer.sampling import SamplingParams

COPY_PROMPT = ("Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes. "
               "Copy: apples, pears, plums, cherries, grapes, lemons, limes. Copy: apples, pears,")
PROMPTS = ["The history of the printing press begins in", "Write a short poem about the sea and the wind.",
           "Explain how a hash table handles collisions.", "List three facts about the planet Mars:"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    model = load_model(default_model_path())
    tok = model.tokenizer
    plain = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    penalized = dataclasses.replace(plain, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                                    logit_bias={int(t): -1.0 for t in np.arange(100, 116)})
    result: dict[str, float] = {"load_before": round(load, 2)}
    # n-gram speculation, one copy-style request: the penalized run only adds a bias on 16
    # tokens it never picks and min_tokens, so both runs accept the same drafts and the
    # ratio is the cost of penalized verify blocks (`penalize_block`, `count_fed` of the kept)
    copy_penalized = dataclasses.replace(plain, min_tokens=8, logit_bias=penalized.logit_bias)
    runs = [("", b, [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(b)], {}, plain, penalized) for b in (1, 8)]
    runs.append(("ngram_", 1, [tok.encode(COPY_PROMPT)], {"speculative": SpeculativeConfig("ngram", 4)}, plain,
                 copy_penalized))
    for prefix, b, ids, options, plain_params, penalized_params in runs:
        engine = Engine(model, EngineConfig(max_slots=b, max_model_len=256, enable_prefix_caching=False, **options))

        def run(params: SamplingParams, n: int) -> float:
            t0 = time.perf_counter()
            engine.generate(ids, dataclasses.replace(params, max_tokens=n, min_tokens=min(params.min_tokens, n)))
            return time.perf_counter() - t0

        pair = (("plain", plain_params), ("penalized", penalized_params))
        for _, params in pair:  # compile every program both need
            run(params, args.new_tokens), run(params, 1)
        times = {"plain": ([], []), "penalized": ([], [])}
        for _ in range(args.repeats):
            for name, params in pair:
                times[name][0].append(run(params, args.new_tokens))
                times[name][1].append(run(params, 1))
        for name, (long, short) in times.items():
            result[f"{prefix}{name}_tok_s_b{b}"] = round((args.new_tokens - 1) * b / (min(long) - min(short)), 1)
        ratio = result[f"{prefix}penalized_tok_s_b{b}"] / result[f"{prefix}plain_tok_s_b{b}"]
        result[f"{prefix}penalized_over_plain_b{b}"] = round(ratio, 3)
        print(f"{prefix}b={b}: plain {result[f'{prefix}plain_tok_s_b{b}']} tok/s, "
              f"penalized {result[f'{prefix}penalized_tok_s_b{b}']} tok/s", flush=True)

    vocab = model.config.vocab_size
    state = init_penalty_state(8, vocab)
    row = slot_history(vocab, ids[0], [], penalized, model.config.eos_ids)
    state = jax.block_until_ready(set_slot(state, np.int32(0), row))
    samples = []
    for i in range(20):
        t0 = time.perf_counter()
        row = slot_history(vocab, ids[0], [], penalized, model.config.eos_ids)
        state = jax.block_until_ready(set_slot(state, np.int32(i % 8), row))
        samples.append(time.perf_counter() - t0)
    result["set_slot_ms"] = round(1e3 * float(np.median(samples)), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
