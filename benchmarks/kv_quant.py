"""KV-cache quantization on SmolLM2-135M: quality, bytes and capacity of every cache format.

Text: `pydoc_data.topics` (offline English). A budgeted plan is calibrated on the first
`--calib-tokens` tokens (`jaxinfer.calibration.calibrate_plan`); every format and the plan
are then evaluated on `--windows` x 1024 later tokens (4096 by default, disjoint from the
calibration text). Each window is prefilled in one step through the real quantized cache
(`init_paged_kv(kv_cache=...)`), so KIVI formats quantize every full page; the reference is
the f32 cache. Reported per format: perplexity and its change, mean next-token KL against
the f32 cache, bytes per token (all layers, K and V, scales and zero-points included), and
how many 1024-token sequences fit in `--kv-gib` of KV memory (KIVI's per-sequence
full-precision tail included). Bytes ratios are against a bf16 cache. Last line: one JSON object.

    python benchmarks/kv_quant.py [--budget-kl 0.01] [--windows 4] [--page-size 16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

FORMATS = ["bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2"]


def capacity(bytes_per_token: float, slot_overhead: float, kv_bytes: float, seq_len: int = 1024) -> int:
    """Sequences of `seq_len` tokens that fit in `kv_bytes` of KV memory."""
    return int(kv_bytes // (seq_len * bytes_per_token + slot_overhead))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-kl", type=float, default=0.01, help="KL budget of the calibrated plan (nats)")
    ap.add_argument("--windows", type=int, default=4, help="evaluation windows of 1024 tokens")
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV memory budget for the capacity column")
    args = ap.parse_args()

    import jax
    import numpy as np

    from jaxinfer.kv import formats as F
    from jaxinfer.calibration import calibrate_plan, evaluate_kv_cache, reference_logits, text_tokens
    from jaxinfer.loading import load_model

    t_start = time.perf_counter()
    model = load_model(progress=False)
    c = model.config
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, {jax.devices()[0].platform}, jax {jax.__version__}; "
          f"SmolLM2-135M f32, page_size {args.page_size}")

    t0 = time.perf_counter()
    plan, calib = calibrate_plan(model, budget_kl=args.budget_kl, n_tokens=args.calib_tokens, seq_len=256,
                                 page_size=args.page_size, probe="int4", log=print)
    print(f"plan for KL <= {args.budget_kl}: {' '.join(plan.formats)} (calibration KL {plan.calibration_kl:.5f}, "
          f"{time.perf_counter() - t0:.0f} s)")

    windows = text_tokens(model.tokenizer, args.windows, 1024, start=args.calib_tokens + 10_000)
    names = ["f32"] + FORMATS + ["plan"]
    kl = {n: [] for n in names}
    nll = {n: [] for n in names}
    t0 = time.perf_counter()
    for w in windows:
        ref = reference_logits(model.params, c, w[None], args.page_size)
        for n in names:
            r = evaluate_kv_cache(model.params, c, w[None], plan if n == "plan" else n, args.page_size, ref_logits=ref)
            kl[n].append(r["kl"])
            nll[n].append(r["nll"])
        del ref
    print(f"evaluated {windows.size} tokens x {len(names)} caches in {time.perf_counter() - t0:.0f} s")

    bf16_bytes = c.n_layers * F.get_format("bf16").bytes_per_token(c.n_kv_heads, c.head_dim, args.page_size)
    kv_bytes = args.kv_gib * 2**30

    def size(n):
        layer_formats = plan.formats if n == "plan" else (n,) * c.n_layers
        per_token = sum(F.get_format(f).bytes_per_token(c.n_kv_heads, c.head_dim, args.page_size) for f in layer_formats)
        overhead = sum(F.get_format(f).slot_overhead_bytes(c.n_kv_heads, c.head_dim, args.page_size, c.dtype) for f in layer_formats)
        return per_token, overhead

    ppl = {n: math.exp(float(np.mean(nll[n]))) for n in names}
    print(f"\n{'cache':>9} {'ppl':>8} {'delta %':>8} {'mean KL':>9} {'B/token':>8} {'vs bf16':>7} {f'seqs@1024 in {args.kv_gib:g} GiB':>22}")
    for n in names:
        per_token, overhead = size(n)
        print(f"{n:>9} {ppl[n]:8.4f} {100 * (ppl[n] / ppl['f32'] - 1):8.3f} {np.mean(kl[n]):9.5f} {per_token:8.0f} "
              f"{per_token / bf16_bytes:7.3f} {capacity(per_token, overhead, kv_bytes):22d}")
    for ps in (16, 32):
        ratios = {n: 0 for n in ("int4", "int2")}
        for n in ratios:
            ratios[n] = F.get_format(n).bytes_per_token(c.n_kv_heads, c.head_dim, ps) / F.get_format("bf16").bytes_per_token(c.n_kv_heads, c.head_dim, ps)
        print(f"bytes vs bf16 at page_size {ps}: int4 {ratios['int4']:.3f}, int2 {ratios['int2']:.3f}")
    print(f"total {time.perf_counter() - t_start:.0f} s")

    def delta(n):
        return round(100 * (ppl[n] / ppl["f32"] - 1), 3)

    result = {
        "f32_ppl": round(ppl["f32"], 4),
        "int8_ppl_delta_pct": delta("int8"),
        "fp8_e4m3_ppl_delta_pct": delta("fp8_e4m3"),
        "int4_ppl_delta_pct": delta("int4"),
        "int8_bytes_ratio": round(size("int8")[0] / bf16_bytes, 4),
        "int4_bytes_ratio": round(size("int4")[0] / bf16_bytes, 4),
        "plan_bytes_ratio": round(size("plan")[0] / bf16_bytes, 4),
        "plan_kl": round(float(np.mean(kl["plan"])), 5),
        "fp8_e5m2_ppl_delta_pct": delta("fp8_e5m2"),
        "int2_ppl_delta_pct": delta("int2"),
        "plan_ppl_delta_pct": delta("plan"),
        "budget_kl": args.budget_kl,
        "tokens": int(windows.size),
        "page_size": args.page_size,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
