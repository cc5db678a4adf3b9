"""Top-p and large top-k without a sort: `filter_logits` against the sorted cut it replaced.

    python benchmarks/sampling.py [--reps 7]

For rows of 1 and 16 over SmolLM2's 49,152-token and Gemma 3's 262,144-token vocabulary
(random logits x 3, temperature 0.8), the jitted `jaxinfer.sampling.filter_logits` with top-p
0.9, and with top-k 1000, against `sorted_filter` below: the same cut taken from a descending
sort and a cumulative sum, as the engine did before. Both must keep the same tokens (checked
here, and in tests/test_sampling.py against float64). Calls alternate; medians in ms.
The last line is JSON: `{case}_ms`, `{case}_sorted_ms` and `{case}_speedup` per case.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling import SamplingArrays, SamplingParams, filter_logits


@jax.jit
def sorted_filter(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Temperature, top-k and top-p by a full sort of each row: f32[B, V] -> f32[B, V]."""
    x = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    vocab = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)
    k = jnp.where((s.top_k > 0) & (s.top_k < vocab), s.top_k, vocab)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    desc = jnp.where(desc >= kth, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    kept = (jnp.cumsum(probs, axis=-1) - probs < s.top_p[:, None]) | (s.top_p[:, None] >= 1) | (jnp.arange(vocab) == 0)
    cut = jnp.maximum(kth, jnp.min(jnp.where(kept, desc, jnp.inf), axis=-1, keepdims=True))
    return jnp.where(x >= cut, x, -jnp.inf)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    fast = jax.jit(filter_logits)
    result = {}
    print(f"{'case':<22}{'search ms':>11}{'sorted ms':>11}{'speedup':>9}")
    for rows, vocab in ((1, 49_152), (16, 49_152), (1, 262_144), (16, 262_144)):
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab)) * 3, jnp.float32)
        for name, params in (("top_p", SamplingParams(temperature=0.8, top_p=0.9)),
                             ("top_k", SamplingParams(temperature=0.8, top_k=1000))):
            s = SamplingArrays.from_params([params] * rows, [0] * rows)
            np.testing.assert_array_equal(np.asarray(fast(logits, s)), np.asarray(sorted_filter(logits, s)))
            times = {"search": [], "sorted": []}
            for _ in range(args.reps):
                times["search"].append(timed(fast, logits, s))
                times["sorted"].append(timed(sorted_filter, logits, s))
            search, sort = (1e3 * float(np.median(times[k])) for k in ("search", "sorted"))
            case = f"{name}_b{rows}_v{vocab // 1024}k"
            result |= {f"{case}_ms": round(search, 2), f"{case}_sorted_ms": round(sort, 2),
                       f"{case}_speedup": round(sort / search, 1)}
            print(f"{case:<22}{search:>11.2f}{sort:>11.2f}{sort / search:>9.1f}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
