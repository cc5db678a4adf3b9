"""One command for a GPU or TPU: every kernel compiled on the device against the reference, then the benchmark.

    python benchmarks/device_check.py [--skip-bench] [--interpret-smoke]

1. Correctness: decode and chunked prefill x every cache format (bf16, int8, fp8_e4m3,
   fp8_e5m2, int4, int2) x (plain; window 40 + 4 sinks + sink logits + soft-cap 30) x
   (32 query / 8 KV heads; MQA 8 / 1), head_dim 128, page 16, bf16 queries, compiled for this
   device (the GPU kernels: Pallas Triton, and on a Hopper GPU also Pallas Mosaic GPU for the
   formats and heads it takes; the TPU kernels: Mosaic TPU) against jaxinfer's jnp
   reference. Edge lengths 0, 1, a page, a page + 1, 129 and 256 tokens (prefill: chunks of 5
   ending at 5 .. 256); NaN in every page no sequence owns, in positions past each length, in
   pages wholly behind the window (options rows) and in other slots' KIVI tails
   (tests/pallas_cases.py builds the inputs). A row passes when the output is finite and
   within atol = rtol = 2**-5 of the reference (bf16 outputs; summation order differs).
   Then the MLA latent decode kernel (bf16 latent cache, its only format) at kv_lora_rank 512
   + RoPE 64 with 16 and 128 heads, page 16, the decode lengths above, NaN wherever no
   sequence may read, against the absorbed reference's latent output.
2. `benchmarks/kernels_gpu.py --skip-checks` (decode bandwidth per format against device copy
   and XLA; on a TPU the same measurement with the TPU kernel).

Prints markdown rows to paste into BENCHMARKS.md and, last, one JSON object
{"device", "checks", "failures", "seconds"}. Exit status 1 if any check failed. Without a GPU
or TPU it prints what it would run and exits 0; `--interpret-smoke` runs a few checks in
interpret mode on any machine (to test this script, not the device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The checks run in worker processes (run_in_workers): none may take the GPU's memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # pallas_cases: the poisoned inputs the tests use

FORMATS = ("dense", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")
HEADS = ((32, 8), (8, 1))
HEAD_DIM, PAGE, MAX_PAGES = 128, 16, 16
DECODE_LENGTHS = [0, 1, PAGE, PAGE + 1, 129, 256]
PREFILL_LENGTHS, CHUNK = [5, PAGE, PAGE + 1, 130, 256], 5
OPTIONS = dict(window=40, num_sinks=4, soft_cap=30.0)
TOLERANCE = 2.0**-5
MLA_HEADS, MLA_RANK, MLA_ROPE_DIM = (16, 128), 512, 64


def plan(smoke: bool, mosaic: bool = False) -> list[tuple[str, str, tuple[int, int], bool, str]]:
    """(kernel, format, heads, with options, kernel family) rows the check runs; `mosaic`: add
    the Mosaic GPU kernels' rows (a Hopper GPU) wherever they take the pages and heads."""
    if smoke:
        return [("decode", "int4", (8, 1), True, "triton"), ("prefill", "fp8_e4m3", (8, 1), True, "triton"),
                ("mla_decode", "dense", (16, 1), False, "triton"), ("decode", "int8", (32, 8), True, "mosaic"),
                ("decode", "int4", (32, 8), True, "mosaic")]
    paged = [(k, f, h, o) for k in ("decode", "prefill") for f in FORMATS for h in HEADS for o in (False, True)]
    mosaic_rows = [(*row, "mosaic") for row in paged if mosaic and mosaic_takes(*row)]  # first: the family JAX keeps
    return mosaic_rows + [(*row, "triton") for row in paged] + [("mla_decode", "dense", (h, 1), False, "triton")
                                                                for h in MLA_HEADS]


def mosaic_takes(kernel: str, fmt: str, heads, with_options: bool) -> bool:
    """Does the Mosaic GPU kernel take this row on a Hopper GPU (`mgpu_supports`)? Its decode and
    KIVI rows are checked although the dispatch sends them to Triton / the reference: a kernel
    gets its device check before it is routed."""
    from pallas_kernels.lowering import Shape, abstract_pages
    from pallas_kernels.paged_attention_mgpu import mgpu_supports

    shape = Shape(q_heads=heads[0], kv_heads=heads[1], head_dim=HEAD_DIM, page_size=PAGE)
    return mgpu_supports(abstract_pages(fmt, shape), heads[0], decode=kernel == "decode")


def behind_window(lengths, t: int) -> list[tuple[int, int]]:
    """(sequence, logical page) pairs wholly between the sinks' page and the window of every
    query of the sequence (queries at lengths - t .. lengths - 1): poisoned in options rows."""
    out = []
    for b, n in enumerate(lengths):
        first_visible = n - t - OPTIONS["window"] + 1  # the earliest query's window start
        out += [(b, p) for p in range(1, MAX_PAGES) if (p + 1) * PAGE <= first_visible]
    return out


def check(kernel: str, fmt: str, heads, with_options: bool, family: str, target: str, interpret: bool) -> dict:
    """One row: the kernel on the device vs the reference -> dict(max_abs_err, ok)."""
    from pallas_cases import make_case, reference
    from pallas_kernels.common import AttentionOptions
    from pallas_kernels.formats import from_layer_kv
    from pallas_kernels.lowering import kernel_function

    if kernel == "mla_decode":
        return check_mla(heads[0], target, interpret)
    t = 1 if kernel == "decode" else CHUNK
    lengths = DECODE_LENGTHS if kernel == "decode" else PREFILL_LENGTHS
    poison = behind_window(lengths, t) if with_options else []
    case = make_case(fmt, "bfloat16", lengths, t=t, heads=heads, head_dim=HEAD_DIM, page=PAGE, max_pages=MAX_PAGES,
                     poison_pages=poison, seed=len(fmt))
    sinks = jnp.linspace(-1.0, 1.0, heads[0]) if with_options else None
    options = OPTIONS if with_options else {}
    fn = kernel_function(kernel, "tpu" if target == "tpu" else "cuda", mosaic_gpu=family == "mosaic")
    q, query_pos = (case.q[:, 0], case.query_index[:, 0]) if kernel == "decode" else (case.q, case.query_index)
    out = fn(q, from_layer_kv(case.layer), case.block_tables, case.lengths, query_pos, sinks, case.slots,
             scale=case.scale, opts=AttentionOptions(**options), interpret=interpret)
    out = np.asarray(out.astype(jnp.float32)).reshape(case.q.shape)
    return compare(out, np.asarray(reference(case, sink_logits=sinks, **options).astype(jnp.float32)))


def check_mla(heads: int, target: str, interpret: bool) -> dict:
    """One MLA row: the latent decode kernel on the device vs the absorbed reference."""
    from pallas_cases import make_mla_case, mla_reference
    from pallas_kernels.lowering import kernel_function

    q_latent, q_rope, latent, block_tables, lengths, scale = make_mla_case(
        DECODE_LENGTHS, heads, MLA_RANK, MLA_ROPE_DIM, PAGE, MAX_PAGES, dtype="bfloat16")
    fn = kernel_function("mla_decode", "tpu" if target == "tpu" else "cuda")
    out = fn(q_latent, q_rope, latent.c_kv, latent.k_rope, block_tables, lengths, scale=scale, interpret=interpret)
    return compare(np.asarray(out), np.asarray(mla_reference(q_latent, q_rope, latent, block_tables, lengths, scale)))


def compare(out: np.ndarray, ref: np.ndarray) -> dict:
    """f32 kernel output vs reference -> dict(max_abs_err, ok): finite and within TOLERANCE."""
    err = float(np.max(np.abs(out - ref))) if np.isfinite(out).all() else float("nan")
    ok = bool(np.isfinite(out).all() and np.all(np.abs(out - ref) <= TOLERANCE + TOLERANCE * np.abs(ref)))
    return dict(max_abs_err=err, ok=ok)


def check_row(kernel: str, fmt: str, heads, with_options: bool, family: str, target: str, device: str,
              interpret: bool) -> str:
    """One check as a markdown row; a kernel that does not compile or run is a failed row."""
    try:
        result = check(kernel, fmt, heads, with_options, family, target, interpret=interpret)
    except Exception as err:  # noqa: BLE001
        result = dict(max_abs_err=float("nan"), ok=False, error=f"{type(err).__name__}: {str(err)[:200]}")
    return (f"{row_label(device, kernel, fmt, heads, with_options, family, target)} {result['max_abs_err']:.3g} | "
            f"{'ok' if result['ok'] else 'FAILED ' + result.get('error', '')} |")


def row_label(device: str, kernel: str, fmt: str, heads, with_options: bool, family: str, target: str) -> str:
    """A row's first six cells: device, kernel, kernels, format, heads, options."""
    return (f"| {device} | {kernel} | {family if target == 'gpu' else 'tpu'} | {fmt} | {heads[0]}/{heads[1]} | "
            f"{'on' if with_options else 'off'} |")


def run_in_workers(rows: list, interpret: bool, device: str, target: str):
    """The rows' markdown lines, run by a worker process that starts over after the row it
    died in (a compiler that crashes the process fails its row, not the rest)."""
    done = 0
    while done < len(rows):
        cmd = [sys.executable, __file__, "--child-from", str(done), "--skip-bench"] + ["--interpret-smoke"] * interpret
        worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        for line in worker.stdout:
            if line.startswith("| "):
                done += 1
                print(line, end="", flush=True)
                yield line.rstrip("\n")
        if worker.wait() != 0 and done < len(rows):
            line = f"{row_label(device, *rows[done], target)} nan | FAILED the process died (exit {worker.returncode}) |"
            print(line, flush=True)
            yield line
            done += 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-bench", action="store_true", help="correctness checks only")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="a few checks in interpret mode on any machine (tests this script, not a device)")
    p.add_argument("--child-from", type=int, help=argparse.SUPPRESS)  # a worker process (run_in_workers)
    args = p.parse_args(argv)
    from jaxinfer.attention.dispatch import hopper

    backend = jax.default_backend()
    rows = plan(args.interpret_smoke, mosaic=hopper())
    if backend not in ("gpu", "tpu") and not args.interpret_smoke:
        print(f"no GPU or TPU found (JAX backend: {backend}): nothing run. On a device this runs:")
        print(f"  {len(rows)} correctness checks (on a Hopper GPU {len(plan(False, mosaic=True)) - len(rows)} more for "
              "the Mosaic GPU kernels), compiled kernels vs the jnp reference: decode and chunked prefill x "
              f"{', '.join(FORMATS)} x (plain; window + sinks + sink logits + soft-cap) x heads "
              f"{' and '.join(f'{a}/{b}' for a, b in HEADS)}, head_dim {HEAD_DIM}, page {PAGE}, lengths "
              f"{DECODE_LENGTHS}, NaN-poisoned foreign pages; MLA latent decode (r {MLA_RANK} + RoPE "
              f"{MLA_ROPE_DIM}, heads {' and '.join(map(str, MLA_HEADS))})")
        print("  then benchmarks/kernels_gpu.py --skip-checks (decode bandwidth per format vs copy and XLA)")
        print(json.dumps(dict(device=None, checks=0, failures=0, seconds=0.0)))
        return 0
    target = "tpu" if backend == "tpu" else "gpu"
    device = "cpu" if args.interpret_smoke else jax.devices()[0].device_kind
    if args.child_from is not None:  # a worker: rows from this index on, one table row each
        for kernel, fmt, heads, with_options, family in rows[args.child_from:]:
            print(check_row(kernel, fmt, heads, with_options, family, target, device, args.interpret_smoke), flush=True)
        return 0
    print(f"device: {device}, jax {jax.__version__}, kernels: {target}")
    start = time.perf_counter()
    print("| device | kernel | kernels | format | heads | options | max abs err | ok |\n"
          "|---|---|---|---|---|---|---|---|")
    table = list(run_in_workers(rows, args.interpret_smoke, device, target))
    failures = sum("| ok |" not in line for line in table)
    if not args.skip_bench and not args.interpret_smoke:
        import kernels_gpu

        kernels_gpu.main(["--skip-checks"])
    seconds = time.perf_counter() - start
    print(json.dumps(dict(device=device, checks=len(rows), failures=failures, seconds=round(seconds, 1))))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
