"""Pallas decode kernels on a CUDA GPU: achieved bandwidth per cache format, against device copy and XLA.

One run, side by side:
  1. device-to-device copy bandwidth (an elementwise pass over a 4 GiB buffer: read + write);
  2. correctness first (the kernels were verified in interpret mode only): every kernel
     (decode and chunked prefill; dense, int8, fp8, int4; window + sinks + soft cap) against
     jaxinfer's jnp reference on small inputs (skip with --skip-checks);
  3. the decode kernels at batch 64, contexts 4,096 and 16,384, 32 query / 8 KV heads,
     head_dim 128, page sizes 16 and 64, caches bf16 / int8 / fp8_e4m3 / int4 (KIVI), and
     the XLA reference path (`paged_attention_reference`) on the same inputs. On a Hopper GPU
     both GPU kernel families run: Pallas Triton (`paged_decode_gpu`) and Pallas Mosaic GPU
     (`paged_attention_mgpu`), each row naming its family.

Timing is device-side: each measurement runs N dependent calls inside one executable
(`lax.fori_loop`, each call's output feeding the next call's query), after a warm-up run, and
divides by N, so host dispatch is excluded. Bytes a decode must read = the cache bytes of
every sequence's tokens, scales included (`jaxinfer.kv.formats.KVFormat.bytes_per_token`);
achieved GB/s = bytes / time.

Last line, one JSON object (figures at context 16,384, the faster page size of each format):
  copy_gbps                device copy bandwidth (bytes read + written per second)
  bf16_frac_of_copy        bf16 kernel GB/s / copy GB/s       (goal >= 0.8)
  int8_frac_of_copy        int8 kernel GB/s / copy GB/s
  int8_speedup_over_bf16   bf16 kernel time / int8 kernel time (goal >= 1.7)
  int4_speedup_over_bf16   bf16 kernel time / int4 kernel time (goal >= 2.8)
  pallas_over_xla_bf16     XLA reference time / bf16 kernel time
  mosaic_over_triton_bf16  Triton bf16 kernel time / Mosaic GPU bf16 kernel time (Hopper only)
  prefill_tflops_bf16      chunked prefill (the last 512 tokens of 8 sequences of 4,096, page
                           16, bf16 cache): the faster kernel's attention TFLOP/s
  mosaic_over_triton_prefill_bf16   Triton prefill time / Mosaic GPU prefill time (Hopper only;
                           the dispatch runs Mosaic GPU prefill there, untimed until now)
The per-format figures take the faster kernel family (on an H200 that was Triton: the dispatch
runs it for decode). Compiled Triton decode over KIVI int4 pages crashed the process on an H200
(jax 0.11.2), so the Triton int4 rows are skipped on a GPU (the dispatch runs the reference
there); the Mosaic GPU kernel's int4 rows run.
On a TPU the same measurement runs the TPU decode kernel (Mosaic); the goals are the GPU's.
On a machine with neither it says so, measures nothing and prints the keys with nulls.

    python benchmarks/kernels_gpu.py [--contexts 4096 16384] [--page-sizes 16 64] [--iters 20] [--skip-checks]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

KEYS = ("copy_gbps", "bf16_frac_of_copy", "int8_frac_of_copy", "int8_speedup_over_bf16", "int4_speedup_over_bf16",
        "pallas_over_xla_bf16", "mosaic_over_triton_bf16", "prefill_tflops_bf16", "mosaic_over_triton_prefill_bf16")
FORMATS = ("bf16", "int8", "fp8_e4m3", "int4")
BATCH, HQ, HKV, DH = 64, 32, 8, 128


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--iters", type=int, default=20, help="dependent calls per timed loop")
    p.add_argument("--repeats", type=int, default=3, help="timed loops per measurement (best is kept)")
    p.add_argument("--prefill-contexts", type=int, nargs="*", default=[4096],
                   help="chunked prefill rows: the last --prefill-chunk tokens of sequences this long (none: skip)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="exercise this script without a GPU: tiny shapes, kernels in interpret mode (figures meaningless)")
    args = p.parse_args(argv)

    interpret = args.interpret_smoke
    if interpret:
        args.contexts, args.page_sizes, args.batch, args.iters, args.repeats = [32], [16], 2, 2, 1
        args.prefill_contexts, args.prefill_chunk, args.prefill_batch = [32], 8, 2
    elif jax.default_backend() not in ("gpu", "tpu"):
        print(f"no GPU found (nor a TPU; JAX backend: {jax.default_backend()}): nothing measured")
        print(json.dumps(dict.fromkeys(KEYS)))
        return 0
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    copy_gbps = copy_bandwidth(args.iters, args.repeats, nbytes=(1 << 20) if interpret else (4 << 30))
    print(f"device copy: {copy_gbps:.0f} GB/s")
    if not args.skip_checks:
        correctness_checks(small=interpret)
    from jaxinfer.attention.dispatch import KIVI_TRITON_DECODE_CRASH, hopper

    families = ["triton", "mosaic"] if hopper() or interpret else ["triton"]
    rows = []
    for fmt in args.formats:  # format by format, so each one's figures print as soon as they are measured
        for context in args.contexts:
            for page_size in args.page_sizes:
                for family in families if jax.default_backend() != "tpu" else ["tpu"]:
                    where = f"format={fmt} kernels={family} context={context} page_size={page_size}"
                    if fmt == "int4" and family == "triton" and not interpret:
                        print(f"{where} skipped: {KIVI_TRITON_DECODE_CRASH}", flush=True)
                        continue
                    try:
                        rows.append(bench_decode(fmt, context, page_size, args.batch, args.iters, args.repeats,
                                                 copy_gbps, interpret, family))
                    except Exception as err:  # noqa: BLE001 - a kernel that fails here is reported, not fatal
                        print(f"{where} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
    prefill_rows = []
    for context in args.prefill_contexts:  # page 16, bf16 and int8: which family should run prefill?
        for fmt in ("bf16", "int8"):
            for family in families if jax.default_backend() != "tpu" else ["tpu"]:
                try:
                    prefill_rows.append(bench_prefill(fmt, context, args.prefill_chunk, 16, args.prefill_batch,
                                                      args.iters, args.repeats, interpret, family))
                except Exception as err:  # noqa: BLE001
                    print(f"prefill format={fmt} kernels={family} context={context} FAILED {type(err).__name__}: "
                          f"{str(err)[:200]}", flush=True)
    print(json.dumps(summary(rows, copy_gbps, max(args.contexts)) | prefill_summary(prefill_rows)))
    return 0


def time_loop(fn, x, operands, iters: int, repeats: int) -> float:
    """Seconds per call of `fn(x, operands)` (-> x-shaped), timed as `iters` dependent calls in one
    executable. `operands` (a pytree: the cache) is an argument, never a baked-in constant."""
    loop = jax.jit(lambda x0, ops: jax.lax.fori_loop(0, iters, lambda i, x: fn(x, ops), x0))
    loop(x, operands).block_until_ready()  # compile + warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop(x, operands).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / iters


def copy_bandwidth(iters: int, repeats: int, nbytes: int) -> float:
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    seconds = time_loop(lambda x, one: x ^ one, x, jnp.uint32(1), iters, repeats)
    return 2 * nbytes / seconds / 1e9


def make_layer(fmt: str, num_pages: int, page_size: int, key, slots: int, dtype=jnp.bfloat16):
    """A random cache layer in `fmt` (jaxinfer.kv.formats layouts), every page full."""
    from jaxinfer.kv import formats as F
    from jaxinfer.kv.dense import LayerKV
    from jaxinfer.kv.kivi import KiviLayerKV
    from jaxinfer.kv.token_quant import TokenQuantLayerKV

    kk, kv = jax.random.split(key)
    shape = (num_pages, page_size, HKV, DH)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    if fmt == "bf16":
        return LayerKV(k, v)
    if fmt in ("int8", "fp8_e4m3"):
        quant = F.quantize_int8 if fmt == "int8" else functools.partial(F.quantize_fp8, dtype=F.fp8_dtype(fmt))
        (kq, ks), (vq, vs) = quant(k), quant(v)
        return TokenQuantLayerKV(kq, vq, ks, vs, format=fmt, dtype=jnp.dtype(dtype).name)
    kq, ks, kz = F.quantize_kivi_keys(k, 4)
    vq, vs, vz = F.quantize_kivi_values(v, 4)
    tail = jnp.zeros((slots, page_size, HKV, DH), dtype)
    return KiviLayerKV(kq, vq, ks, kz, vs, vz, tail, tail, format="int4")


def bench_decode(fmt: str, context: int, page_size: int, batch: int, iters: int, repeats: int, copy_gbps: float,
                 interpret: bool = False, family: str = "triton"):
    from jaxinfer.kv import formats as F
    from jaxinfer.attention.reference import paged_attention_reference
    from pallas_kernels.formats import from_layer_kv
    from pallas_kernels.lowering import kernel_function

    decode = kernel_function("decode", "tpu" if family == "tpu" else "cuda", mosaic_gpu=family == "mosaic")
    layer, tables, lengths, slots = full_cache(fmt, context, page_size, batch)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, HQ, DH), jnp.bfloat16)
    scale = 1 / math.sqrt(DH)

    def kernel(q, layer):
        return decode(q, from_layer_kv(layer), tables, lengths, slots=slots, scale=scale, interpret=interpret)

    def xla(q, layer):
        return paged_attention_reference(q[:, None], layer, tables, lengths, (lengths - 1)[:, None], scale,
                                         slots=slots)[:, 0]

    diff = jax.jit(kernel)(q, layer).astype(jnp.float32) - jax.jit(xla)(q, layer).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(diff)))
    t_kernel = time_loop(kernel, q, layer, iters, repeats)
    t_xla = time_loop(xla, q, layer, iters, repeats)
    nbytes = batch * context * F.get_format(fmt).bytes_per_token(HKV, DH, page_size)
    row = dict(format=fmt, kernels=family, context=context, page_size=page_size, kernel_ms=t_kernel * 1e3,
               xla_ms=t_xla * 1e3,
               kernel_gbps=nbytes / t_kernel / 1e9, xla_gbps=nbytes / t_xla / 1e9, max_abs_err=err)
    row["frac_of_copy"] = row["kernel_gbps"] / copy_gbps
    report(row)
    return row


def report(row: dict) -> None:
    """One measured row as `key=value` pairs on a line."""
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def full_cache(fmt: str, context: int, page_size: int, batch: int):
    """(layer, block tables i32[batch, context / page_size], lengths i32[batch], slots i32[batch]):
    `batch` sequences of `context` tokens in shuffled pages of a random `fmt` cache."""
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq + 1
    layer = make_layer(fmt, num_pages, page_size, jax.random.PRNGKey(context + page_size), batch)
    perm = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    tables = jnp.asarray(perm.reshape(batch, pages_per_seq), jnp.int32)
    return layer, tables, jnp.full((batch,), context, jnp.int32), jnp.arange(batch, dtype=jnp.int32)


def bench_prefill(fmt: str, context: int, chunk: int, page_size: int, batch: int, iters: int, repeats: int,
                  interpret: bool = False, family: str = "triton") -> dict:
    """The last `chunk` tokens of `batch` sequences of `context` tokens, as one chunked-prefill
    call (their K/V already in the pages, as the engine writes them first) -> TFLOP/s of the
    attention matmuls (QK^T and PV over each query's causal span), and the XLA reference's."""
    from jaxinfer.attention.reference import paged_attention_reference
    from pallas_kernels.formats import from_layer_kv
    from pallas_kernels.lowering import kernel_function

    prefill = kernel_function("prefill", "tpu" if family == "tpu" else "cuda", mosaic_gpu=family == "mosaic")
    layer, tables, lengths, slots = full_cache(fmt, context, page_size, batch)
    q = jax.random.normal(jax.random.PRNGKey(2), (batch, chunk, HQ, DH), jnp.bfloat16)
    query_pos = jnp.broadcast_to(context - chunk + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
    scale = 1 / math.sqrt(DH)

    def kernel(q, layer):
        return prefill(q, from_layer_kv(layer), tables, lengths, query_pos, slots=slots, scale=scale,
                       interpret=interpret)

    def xla(q, layer):
        return paged_attention_reference(q, layer, tables, lengths, query_pos, scale, slots=slots)

    err = float(jnp.max(jnp.abs(jax.jit(kernel)(q, layer).astype(jnp.float32)
                                - jax.jit(xla)(q, layer).astype(jnp.float32))))
    t_kernel = time_loop(kernel, q, layer, iters, repeats)
    t_xla = time_loop(xla, q, layer, iters, repeats)
    flops = 4 * batch * HQ * DH * float(np.sum(context - chunk + 1 + np.arange(chunk)))  # 2 matmuls x 2 flops
    row = dict(kernel="prefill", format=fmt, kernels=family, context=context, chunk=chunk, page_size=page_size,
               kernel_ms=t_kernel * 1e3, xla_ms=t_xla * 1e3, kernel_tflops=flops / t_kernel / 1e12,
               xla_tflops=flops / t_xla / 1e12, max_abs_err=err)
    report(row)
    return row


def summary(rows, copy_gbps: float, context: int) -> dict:
    best = {}
    for r in rows:
        if r["context"] == context and (r["format"] not in best or r["kernel_ms"] < best[r["format"]]["kernel_ms"]):
            best[r["format"]] = r

    def get(fmt, key):
        return best[fmt][key] if fmt in best else None

    def family_ms(fmt, family):
        times = [r["kernel_ms"] for r in rows if (r["format"], r["kernels"], r["context"]) == (fmt, family, context)]
        return min(times) if times else None

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    return {
        "copy_gbps": copy_gbps,
        "bf16_frac_of_copy": get("bf16", "frac_of_copy"),
        "int8_frac_of_copy": get("int8", "frac_of_copy"),
        "int8_speedup_over_bf16": ratio(get("bf16", "kernel_ms"), get("int8", "kernel_ms")),
        "int4_speedup_over_bf16": ratio(get("bf16", "kernel_ms"), get("int4", "kernel_ms")),
        "pallas_over_xla_bf16": ratio(get("bf16", "xla_ms"), get("bf16", "kernel_ms")),
        "mosaic_over_triton_bf16": ratio(family_ms("bf16", "triton"), family_ms("bf16", "mosaic")),
    }


def prefill_summary(rows) -> dict:
    """The prefill keys: the fastest bf16 kernel's TFLOP/s, and Triton time / Mosaic GPU time."""
    ms = {r["kernels"]: r["kernel_ms"] for r in rows if r["format"] == "bf16"}
    best = min(ms.values()) if ms else None
    return dict(prefill_tflops_bf16=next((r["kernel_tflops"] for r in rows if r["format"] == "bf16"
                                          and r["kernel_ms"] == best), None),
                mosaic_over_triton_prefill_bf16=ms["triton"] / ms["mosaic"] if {"triton", "mosaic"} <= ms.keys()
                else None)


def correctness_checks(small: bool = False) -> None:
    """Every kernel, compiled, against the reference on small inputs (bf16 activations)."""
    from jaxinfer.attention.reference import paged_attention_reference
    from jaxinfer.attention.dispatch import paged_attention

    b, t, page_size, pages_per_seq = 4, 8, 16, 2 if small else 8
    num_pages = b * pages_per_seq + 1
    tables = jnp.asarray(np.random.default_rng(1).permutation(np.arange(1, num_pages)).reshape(b, -1), jnp.int32)
    lengths = jnp.array([1, 16, 17, 30 if small else 100], jnp.int32)
    slots = jnp.array([2, 0, 3, 1], jnp.int32)
    sinks = jnp.linspace(-1.0, 1.0, HQ)
    failures = 0
    for fmt in FORMATS[-1:] if small else FORMATS:
        layer = make_layer(fmt, num_pages, page_size, jax.random.PRNGKey(7), b)
        if fmt == "int4":  # a current page partly in the tail
            layer = layer.replace(k_tail=jax.random.normal(jax.random.PRNGKey(8), layer.k_tail.shape, jnp.bfloat16),
                                  v_tail=jax.random.normal(jax.random.PRNGKey(9), layer.v_tail.shape, jnp.bfloat16))
        for tq in (1, t):
            q = jax.random.normal(jax.random.PRNGKey(tq), (b, tq, HQ, DH), jnp.bfloat16)
            qi = jnp.maximum(lengths[:, None] - tq + jnp.arange(tq)[None, :], 0)
            for options in (dict(), dict(window=20 if small else 40, num_sinks=4, soft_cap=30.0, sink_logits=sinks)):
                args = (q, layer, tables, lengths, qi)
                common = dict(scale=1 / math.sqrt(DH), slots=slots, **options)
                out = jax.jit(functools.partial(paged_attention, impl="pallas", **common))(*args)
                ref = jax.jit(functools.partial(paged_attention_reference, **common))(*args)
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                ok = err <= 2.0**-5 and bool(jnp.isfinite(out.astype(jnp.float32)).all())
                failures += not ok
                print(f"check {fmt:9s} T={tq} options={sorted(options)}: max abs err {err:.3g} {'ok' if ok else 'FAILED'}")
    print(f"correctness: {failures} failed")


if __name__ == "__main__":
    sys.exit(main())
