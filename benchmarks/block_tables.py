"""Host cost of the block tables per step, at many slots and long contexts (issue 21).

    python benchmarks/block_tables.py [--slots 64] [--max-model-len 4096] [--steps 200]

A tiny random model (2 layers, d_model 32), so the device part of a step is small and the
host's part shows: `--slots` requests with 1,000-3,000-token prompts decode greedily in an
engine of `max_model_len` tokens per slot (page_size 16: 256 block-table columns at 4096).
After the prompts are in, `--steps` decode steps are timed with `StepTimer`:
`host_ms_per_step` (p50 of `Engine.step` wall time minus its programs, as in `serving.py`)
and `step_ms` (p50 of the whole step). The script uses only `Engine`'s public API, so the
same file runs against another checkout (PYTHONPATH) for a before/after in one session.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from step_timer import StepTimer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    from jaxinfer.config import ModelConfig
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.loading import Model
    from jaxinfer.model import init_random_params
    from jaxinfer.sampling import SamplingParams

    config = ModelConfig(arch="llama", vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                         ffn_dim=48, rope_theta=10000.0, max_position=args.max_model_len)
    model = Model(config=config, params=init_random_params(config, seed=0), tokenizer=None)
    engine = Engine(model, EngineConfig(max_slots=args.slots, page_size=16, max_model_len=args.max_model_len,
                                        prefill_chunk=256, max_prefill_rows=4, enable_prefix_caching=False,
                                        min_context_bucket=args.max_model_len))  # one bucket: the whole row
    engine.warmup()
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True)
    for _ in range(args.slots):
        engine.add_request(rng.integers(0, 97, int(rng.integers(1000, 3000))).tolist(), params)
    while any(r.pending > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill every prompt first: the timed steps all decode
    steps = []
    with StepTimer(engine) as timer:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    print(json.dumps({"slots": args.slots, "max_model_len": args.max_model_len, "steps": args.steps,
                      "host_ms_per_step": round(timer.host_ms_per_step, 3),
                      "step_ms": round(1e3 * float(np.median(steps)), 3)}))


if __name__ == "__main__":
    main()
