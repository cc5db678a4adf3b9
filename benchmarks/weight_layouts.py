"""One weight layout or all three on XLA:CPU (`EngineConfig.weight_layouts`), side by side.

    python benchmarks/weight_layouts.py [--reps 6]

SmolLM2-135M f32, the engine programs `benchmarks/verify_profile.py` times (every slot
decoding greedily at context 96): the plain step at b = 1 and 16 and the verify program with
k = 2 and 4 n-gram drafts at b = 1 (k = 4 at b = 16), built once with the dense layers'
weights in the checkpoint's [out, in] layout only ("one") and once also as column panels and
transposed ("all", `jaxinfer.model.layers.LinearLayouts`), all programs timed interleaved
round by round. Last line: JSON with each program's ms per layout, "all" over "one" per
program (`speedup_*`) and the verify cost (verify program / plain step) per layout.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from verify_profile import Program, decode_batch, timed

from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import load_model
from jaxinfer.speculative.config import SpeculativeConfig
from jaxinfer.speculative.step import DraftBatch

LAYOUTS = ("one", "all")


def programs(model, layouts: str) -> dict[str, Program]:
    out = {}
    for b, ks in ((1, (2, 4)), (16, (4,))):
        eng = Engine(model, EngineConfig(max_slots=b, page_size=32, max_model_len=256, prefill_chunk=128,
                                         enable_prefix_caching=False, speculative=SpeculativeConfig("ngram", max(ks)),
                                         weight_layouts=layouts))
        batch = decode_batch(eng)
        out[f"plain_b{b}"] = Program(*eng._program(batch, None, eng.kv, None), 2)
        for k in ks:
            drafts = DraftBatch(tokens=np.tile(np.arange(200, 200 + k, dtype=np.int32), (b, 1)),
                                num_draft=np.full(b, k, np.int32))
            out[f"k{k}_b{b}"] = Program(*eng._program(batch, drafts, eng.kv, eng.draft_kv), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    model = load_model(progress=False)
    summary = {"load_before": round(os.getloadavg()[0], 2)}
    progs = {f"{layouts}.{name}": p for layouts in LAYOUTS for name, p in programs(model, layouts).items()}
    ms = {name: 1e3 * t for name, t in timed(progs, args.reps).items()}
    names = [name.split(".", 1)[1] for name in progs if name.startswith("one.")]
    print(f"{'program':<10}{'one ms':>9}{'all ms':>9}{'one/all':>10}")
    for name in names:
        one, every = ms[f"one.{name}"], ms[f"all.{name}"]
        print(f"{name:<10}{one:>9.2f}{every:>9.2f}{one / every:>9.2f}x")
        summary |= {f"{name}_ms_one": round(one, 2), f"{name}_ms_all": round(every, 2),
                    f"speedup_{name}": round(one / every, 3)}
    for layouts in LAYOUTS:
        for name in names:
            if not name.startswith("plain"):
                b = name.split("_")[1]
                summary[f"verify_cost_{name}_{layouts}"] = round(ms[f"{layouts}.{name}"] / ms[f"{layouts}.plain_{b}"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
