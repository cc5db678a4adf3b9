"""Lower the kernels for devices this machine does not have (TPU, CUDA) with `jax.export`.

`lower(kernel, target, fmt, shape)` exports one kernel over abstract inputs
(`jax.ShapeDtypeStruct`, no data) for another platform, which runs the kernel's whole
Python-side compiler path: grid and block shapes, index maps, scalar prefetch, dtype casts,
and the Pallas lowering to the target's kernel dialect::

    target      platform  lowering                          what the lowering asks for
    tpu_v5e     tpu       Pallas Mosaic TPU (tpu_custom_call)  the chip: an abstract TPU device
    tpu_v6e     tpu       Pallas Mosaic TPU                    under `use_abstract_mesh`
    cuda_sm90   cuda      Pallas Triton (__gpu$xla.gpu.triton) nothing chip-specific; the custom
                                                               call is not export-stable, so its
                                                               safety check is disabled
    cuda_sm90_mosaic cuda Pallas Mosaic GPU (mosaic_gpu_v2)    decode and prefill, the formats and
                                                               shapes paged_attention_mgpu takes
                                                               (the rest is dispatched to Triton)

What it does not prove: the device-side compilers (libtpu's Mosaic passes, Triton's PTX
compile) run only on the device; `benchmarks/device_check.py` runs the kernels there.

    python -m pallas_kernels.lowering     # the whole matrix, one line per failure, then the counts
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.common import AttentionOptions, cdiv
from pallas_kernels.formats import KERNEL_FORMATS, KernelPages

KERNELS = ("decode", "prefill", "mla_decode")
MOSAIC_GPU = "cuda_sm90_mosaic"  # the Mosaic GPU kernels (paged_attention_mgpu), what a Hopper GPU runs
TARGETS = {"tpu_v5e": ("tpu", "TPU v5e"), "tpu_v6e": ("tpu", "TPU v6e"), "cuda_sm90": ("cuda", None),
           MOSAIC_GPU: ("cuda", "mosaic")}
CUSTOM_CALL = {"tpu_v5e": "tpu_custom_call", "tpu_v6e": "tpu_custom_call", "cuda_sm90": "__gpu$xla.gpu.triton",
               MOSAIC_GPU: "mosaic_gpu_v2"}
# Production mask options (Gemma-3-like window, StreamingLLM sinks, Gemma-2 soft-cap), with sink logits.
OPTIONS = AttentionOptions(window=1024, num_sinks=4, soft_cap=50.0)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Sizes of one lowering: `batch` sequences of `context` tokens, a prefill chunk of `chunk` queries."""

    batch: int = 8
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    context: int = 2048
    chunk: int = 64

    @property
    def max_pages(self) -> int:
        return cdiv(self.context, self.page_size)

    def label(self) -> str:
        return (f"b{self.batch} h{self.q_heads}/{self.kv_heads} d{self.head_dim} page{self.page_size} "
                f"ctx{self.context}")


BASE = Shape()
# Shape sweep (one format): MQA, head_dim 64 / 128 / 256 (Gemma 3), pages 16 and 64, batch 8-64, contexts to 8k.
SWEEP = (
    Shape(batch=64, q_heads=8, kv_heads=1, head_dim=128, page_size=16, context=8192),
    Shape(batch=8, q_heads=32, kv_heads=8, head_dim=64, page_size=64, context=8192),
    Shape(batch=16, q_heads=8, kv_heads=4, head_dim=256, page_size=16, context=4096),
    Shape(batch=64, q_heads=32, kv_heads=8, head_dim=128, page_size=64, context=1024),
)


@dataclasses.dataclass(frozen=True)
class MlaShape:
    """Sizes of an MLA decode lowering: `heads` query heads against a latent cache of
    kv_lora_rank `rank` + RoPE key `rope_dim` per token (DeepSeek-V3: 512 + 64, 128 heads)."""

    batch: int = 8
    heads: int = 16
    rank: int = 512
    rope_dim: int = 64
    page_size: int = 16
    context: int = 2048

    @property
    def max_pages(self) -> int:
        return cdiv(self.context, self.page_size)

    def label(self) -> str:
        return f"b{self.batch} h{self.heads} r{self.rank}+{self.rope_dim} page{self.page_size} ctx{self.context}"


# MLA decode (bf16 latent cache, its only format): 16 heads (128 over 8 devices) and all 128.
MLA_SHAPES = (
    MlaShape(),
    MlaShape(batch=64, context=8192),
    MlaShape(batch=32, heads=128, page_size=64, context=4096),
)


def abstract_pages(fmt: str, shape: Shape, dtype=jnp.bfloat16) -> KernelPages:
    """A cache layer of `fmt` (formats.py layouts) as ShapeDtypeStructs: one pool page per
    (sequence, logical page) plus the null page; KIVI tails per sequence."""
    from jaxinfer.kv import formats as F

    sds = jax.ShapeDtypeStruct
    p, s, h, d = shape.batch * shape.max_pages + 1, shape.page_size, shape.kv_heads, shape.head_dim
    if fmt == "dense":
        return KernelPages(k=sds((p, s, h, d), dtype), v=sds((p, s, h, d), dtype))
    stored = jnp.dtype(F.get_format(fmt).storage_dtype)
    if fmt in ("int4", "int2"):
        x = d * F.get_format(fmt).bits // 8
        channel, token, tail = sds((p, h, d), dtype), sds((p, s, h), dtype), sds((shape.batch, s, h, d), dtype)
        return KernelPages(k=sds((p, s, h, x), stored), v=sds((p, s, h, x), stored), k_scale=channel,
                           k_zero=channel, v_scale=token, v_zero=token, k_tail=tail, v_tail=tail, format=fmt)
    token = sds((p, s, h), dtype)
    return KernelPages(k=sds((p, s, h, d), stored), v=sds((p, s, h, d), stored), k_scale=token, v_scale=token,
                       format=fmt)


def kernel_function(kernel: str, platform: str, mosaic_gpu: bool = False):
    """The kernel entry point of `kernel` (one of KERNELS) for `platform` ("tpu" | "cuda"; on
    CUDA the Mosaic GPU kernels with `mosaic_gpu`)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    if mosaic_gpu:
        if kernel == "mla_decode":
            raise ValueError("no Mosaic GPU kernel for 'mla_decode' (the Triton one runs there)")
        from pallas_kernels.paged_attention_mgpu import chunked_prefill_mgpu, paged_decode_mgpu
        return paged_decode_mgpu if kernel == "decode" else chunked_prefill_mgpu
    if kernel == "mla_decode":
        from pallas_kernels.mla_decode_gpu import mla_decode_gpu
        from pallas_kernels.mla_decode_tpu import mla_decode_tpu
        return mla_decode_tpu if platform == "tpu" else mla_decode_gpu
    if platform == "tpu":
        from pallas_kernels.chunked_prefill_tpu import chunked_prefill_tpu
        from pallas_kernels.paged_decode_tpu import paged_decode_tpu
        return paged_decode_tpu if kernel == "decode" else chunked_prefill_tpu
    from pallas_kernels.chunked_prefill_gpu import chunked_prefill_gpu
    from pallas_kernels.paged_decode_gpu import paged_decode_gpu
    return paged_decode_gpu if kernel == "decode" else chunked_prefill_gpu


def abstract_args(kernel: str, fmt: str, shape: Shape, with_options: bool) -> tuple:
    """(q, pages, block_tables, lengths, query_pos, sink_logits, slots) as ShapeDtypeStructs."""
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    b, hq, dh = shape.batch, shape.q_heads, shape.head_dim
    q_shape, pos_shape = ((b, hq, dh), (b,)) if kernel == "decode" else ((b, shape.chunk, hq, dh), (b, shape.chunk))
    sinks = sds((hq,), jnp.float32) if with_options else None
    return (sds(q_shape, jnp.bfloat16), abstract_pages(fmt, shape), sds((b, shape.max_pages), i32), sds((b,), i32),
            sds(pos_shape, i32), sinks, sds((b,), i32))


def abstract_mla_args(shape: MlaShape) -> tuple:
    """(q_latent, q_rope, c_kv, k_rope, block_tables, lengths) as ShapeDtypeStructs: bf16, one
    pool page per (sequence, logical page) plus the null page."""
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    b, h, p = shape.batch, shape.heads, shape.batch * shape.max_pages + 1
    return (sds((b, h, shape.rank), bf16), sds((b, h, shape.rope_dim), bf16),
            sds((p, shape.page_size, shape.rank), bf16), sds((p, shape.page_size, shape.rope_dim), bf16),
            sds((b, shape.max_pages), jnp.int32), sds((b,), jnp.int32))


def lower(kernel: str, target: str, fmt: str, shape: Shape | MlaShape = BASE, with_options: bool = False) -> str:
    """Export `kernel` for `target` (a key of TARGETS) over abstract inputs -> the StableHLO text.

    Raises whatever the kernel's lowering raises (the point of calling it)."""
    if target not in TARGETS:
        raise ValueError(f"target={target!r} must be one of {tuple(TARGETS)}")
    if fmt not in KERNEL_FORMATS:
        raise ValueError(f"fmt={fmt!r} must be one of {KERNEL_FORMATS}")
    platform, device_kind = TARGETS[target]
    fn = kernel_function(kernel, platform, mosaic_gpu=device_kind == "mosaic")
    if kernel == "mla_decode":  # the latent cache has one format (bf16) and no mask options
        if fmt != "dense" or with_options or not isinstance(shape, MlaShape):
            raise ValueError("mla_decode lowers for fmt='dense', no options and an MlaShape only")
        scale = (shape.rank + shape.rope_dim) ** -0.5
        jitted = jax.jit(lambda *args: fn(*args, scale=scale))  # a fresh jit: nothing cached
        args = abstract_mla_args(shape)
    else:
        opts = OPTIONS if with_options else AttentionOptions()
        scale = shape.head_dim ** -0.5
        jitted = jax.jit(lambda *args: fn(*args, scale=scale, opts=opts))
        args = abstract_args(kernel, fmt, shape, with_options)
    if platform == "cuda":
        check = jax.export.DisabledSafetyCheck.custom_call(CUSTOM_CALL["cuda_sm90"])
        return jax.export.export(jitted, platforms=["cuda"], disabled_checks=[check])(*args).mlir_module()
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.export.export(jitted, platforms=["tpu"])(*args).mlir_module()


def matrix(sweep_formats: tuple[str, ...] = ("dense", "int4", "int2")) -> list[tuple[str, str, str, Shape, bool]]:
    """(kernel, target, format, shape, options) combinations: for decode and chunked prefill
    the full kernel x target x format x options product at BASE, then the SWEEP shapes with
    options x `sweep_formats` (default: the formats a shape could break differently, dense and
    the packed int4 / int2); for MLA decode every target x MLA_SHAPES (bf16, no options)."""
    paged = ("decode", "prefill")
    triton = [t for t in TARGETS if t != MOSAIC_GPU]
    full = [(k, t, f, BASE, o) for k, t, f, o in itertools.product(paged, triton, KERNEL_FORMATS, (False, True))]
    sweep = [(k, t, f, s, True) for k, t, s, f in itertools.product(paged, triton, SWEEP, sweep_formats)]
    mla = [("mla_decode", t, "dense", s, False) for t, s in itertools.product(triton, MLA_SHAPES)]
    return full + sweep + mla + mosaic_matrix()


def mosaic_matrix() -> list[tuple[str, str, str, Shape, bool]]:
    """The Mosaic GPU kernels (decode, prefill): their formats x options at BASE and SWEEP, where
    their tiles take them (`mgpu_supports`: KIVI pages included, though the dispatch sends those
    to Triton; elsewhere the Triton kernels, lowered above)."""
    from pallas_kernels.paged_attention_mgpu import MGPU_FORMATS, mgpu_supports

    kernels, shapes = ("decode", "prefill"), (BASE, *SWEEP)
    return [(k, MOSAIC_GPU, f, s, o) for k, s, f, o in itertools.product(kernels, shapes, MGPU_FORMATS,
                                                                                 (False, True))
            if mgpu_supports(abstract_pages(f, s), s.q_heads, decode=k == "decode")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pallas_kernels.lowering",
        description="Export every Pallas kernel x target x cache format x option set with jax.export (`matrix`) "
                    "and print a table of what lowered; exit status 1 if anything failed. Runs on CPU.")
    parser.add_argument("--kernel", choices=KERNELS, action="append", help="only this kernel (repeatable)")
    parser.add_argument("--target", choices=tuple(TARGETS), action="append", help="only this target (repeatable)")
    parser.add_argument("--format", choices=KERNEL_FORMATS, action="append", dest="formats",
                        help="only this cache format (repeatable)")
    args = parser.parse_args(argv)
    rows = [row for row in matrix() if (args.kernel is None or row[0] in args.kernel)
            and (args.target is None or row[1] in args.target) and (args.formats is None or row[2] in args.formats)]
    if not rows:
        parser.error("no combination matches these filters")
    counts: dict[tuple[str, str], list[int]] = {}
    start = time.perf_counter()
    for kernel, target, fmt, shape, with_options in rows:
        tally = counts.setdefault((kernel, target), [0, 0])
        tally[0] += 1
        try:
            lower(kernel, target, fmt, shape, with_options)
        except Exception as err:  # noqa: BLE001 - every failure is a row of the report
            tally[1] += 1
            print(f"FAIL {kernel} {target} {fmt} {shape.label()} options={with_options}: {type(err).__name__}: "
                  f"{str(err)[:300]}")
    print("| kernel | target | combinations lowered | failures |\n|---|---|---|---|")
    for (kernel, target), (n, failed) in counts.items():
        print(f"| {kernel} | {target} | {n - failed} / {n} | {failed} |")
    total, failed = sum(n for n, _ in counts.values()), sum(f for _, f in counts.values())
    print(f"total {total - failed} / {total} lowered, {failed} failures, {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
