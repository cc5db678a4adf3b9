"""What penalties and logit bias cost a decode step: SmolLM2-135M, f32, greedy.

One engine per batch size (1 and 8) decodes the same prompts plain and with every request
penalized (repetition 1.1, frequency 0.3, presence 0.2 and a 16-token logit bias), the two
alternating; decode tok/s = (new tokens - 1) x batch / (time(N tokens) - time(1 token)), best
of `--repeats`. Penalized steps add `count_fed` and `penalize` over [rows, 49,152] to the
plain step (`jaxinfer.penalties`); each admission writes one slot's row.

    python benchmarks/penalties.py [--new-tokens 48] [--repeats 3]

Last line, JSON: `plain_tok_s_b{1,8}`, `penalized_tok_s_b{1,8}`, `penalized_over_plain_b{1,8}`,
`set_slot_ms` (one admission's row write).
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
from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import load_model
from jaxinfer.penalties import init_penalty_state, set_slot, slot_history
from jaxinfer.sampling import SamplingParams

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
    for b in (1, 8):
        ids = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(b)]
        engine = Engine(model, EngineConfig(max_slots=b, max_model_len=256, enable_prefix_caching=False))

        def run(params: SamplingParams, n: int) -> float:
            t0 = time.perf_counter()
            engine.generate(ids, dataclasses.replace(params, max_tokens=n))
            return time.perf_counter() - t0

        for params in (plain, penalized):  # compile every program both need
            run(params, args.new_tokens), run(params, 1)
        times = {"plain": ([], []), "penalized": ([], [])}
        for _ in range(args.repeats):
            for name, params in (("plain", plain), ("penalized", penalized)):
                times[name][0].append(run(params, args.new_tokens))
                times[name][1].append(run(params, 1))
        for name, (long, short) in times.items():
            result[f"{name}_tok_s_b{b}"] = round((args.new_tokens - 1) * b / (min(long) - min(short)), 1)
        result[f"penalized_over_plain_b{b}"] = round(result[f"penalized_tok_s_b{b}"] / result[f"plain_tok_s_b{b}"], 3)
        print(f"b={b}: plain {result[f'plain_tok_s_b{b}']} tok/s, penalized {result[f'penalized_tok_s_b{b}']} tok/s",
              flush=True)

    vocab = model.config.vocab_size
    state = init_penalty_state(8, vocab)
    row = slot_history(vocab, ids[0], [], 1.1, 0.3, 0.2, penalized.logit_bias)
    state = jax.block_until_ready(set_slot(state, np.int32(0), row))
    samples = []
    for i in range(20):
        t0 = time.perf_counter()
        row = slot_history(vocab, ids[0], [], 1.1, 0.3, 0.2, penalized.logit_bias)
        state = jax.block_until_ready(set_slot(state, np.int32(i % 8), row))
        samples.append(time.perf_counter() - t0)
    result["set_slot_ms"] = round(1e3 * float(np.median(samples)), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
