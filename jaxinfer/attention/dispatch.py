"""The one entry the model calls for attention: every variant, by `impl`, reference or kernel.

    variant                 function              reference                        kernels
    paged (MHA/GQA/MQA,     paged_attention       paged_attention_reference        decode (T == 1) and
      window, sinks,                                                               chunked prefill, GPU
      sink logits, soft-cap)                                                       and TPU, every
                                                                                   per-head cache format
    StreamingLLM ring       streaming_attention   streaming_attention_reference    none
    MLA latent              mla_attention         mla_attention_reference          absorbed decode (T == 1),
                                                                                   GPU and TPU; prefill
                                                                                   (expanded) reference

`impl` (the engine's `attention_impl`):

    "reference"            the jnp reference (`jaxinfer.attention.reference`)
    "pallas"               the kernels of the backend: GPU kernels on GPU, TPU (Mosaic TPU) on TPU;
                           on CPU the GPU-style (Triton) kernels in interpret mode (slow: tests only)
    "pallas_gpu" / "pallas_tpu"   that target's kernels (interpret mode off their backend)
    "auto"                 kernels on GPU/TPU when they take this variant, cache and shapes, else
                           the reference (always the reference on CPU); the engine's default.
                           A program whose kernel fails to compile on the device falls back to
                           the reference (`jaxinfer.engine.Engine`, one warning per kernel)

Which GPU kernel runs (`gpu_kernel_family`), as measured on an H200 (jax 0.11.2, BENCHMARKS.md):
decode runs the Pallas Triton kernel (`paged_decode_gpu`: 0.78 of copy bandwidth in bf16,
1.4x-2.2x the Mosaic GPU decode kernel); chunked prefill on Hopper (compute capability 9.x) runs
the Pallas Mosaic GPU kernel (`pallas_kernels.paged_attention_mgpu`, wgmma) over dense
bf16/f16, int8 and fp8 pages where its tiles fit, and the Triton kernel elsewhere (f32 and
KIVI pages, pre-Hopper GPUs). Triton is deprecated from JAX 0.11 but is the only Pallas
lowering before Hopper. MLA decode has a Triton kernel only. Compiled Triton decode over KIVI
int4/int2 pages crashed the process on that H200, so GPU decode over KIVI pages runs the
reference (`unsupported_reason`).

A kernel impl asked for a variant or cache it has no kernel for raises ValueError saying
why; "auto" falls back to the reference. The kernels (`pallas_kernels`) know the cache
formats and jax only; they are imported here on first use, so the reference path never
loads Pallas.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

from jaxinfer.attention.reference import (absorb_query, expand_latent_output, mla_attention_reference,
                                          paged_attention_reference, streaming_attention_reference)
from jaxinfer.kv.latent import LatentKV
from jaxinfer.kv.layer_cache import LayerCache, own_layer
from jaxinfer.kv.streaming import StreamingSpec

IMPLS = ("auto", "reference", "pallas", "pallas_gpu", "pallas_tpu")
KIVI_TRITON_DECODE_CRASH = ("the compiled Triton decode kernel over KIVI pages crashed the process (segmentation "
                            "fault) on an H200 with jax 0.11.2; GPU decode over KIVI pages runs the reference")
KERNEL_IMPLS = ("pallas", "pallas_gpu", "pallas_tpu")


def paged_attention(
    q: jax.Array,  # [B, T, Hq, Dh]: queries, already rotated
    layer_kv: LayerCache,  # one layer's cache, this step's keys and values already written
    block_tables: jax.Array,  # i32[B, max_pages]
    kv_lengths: jax.Array,  # i32[B]: cached tokens per sequence, this step's included
    query_index: jax.Array,  # i32[B, T]: cache position of each query (causal limit)
    scale: float,
    *,
    window: int | None = None,
    num_sinks: int = 0,
    sink_logits: jax.Array | None = None,  # f32[Hq]
    soft_cap: float | None = None,
    slots: jax.Array | None = None,  # i32[B]: cache slot of each row (KIVI tails)
    impl: str = "auto",
) -> jax.Array:
    """Causal GQA attention through block tables -> [B, T, Hq, Dh] (dtype of q), by `impl`.

    q: [B, T, Hq, Dh], already rotated; query head h reads KV head h // (Hq / Hkv) (heads
    grouped contiguously). layer_kv: one layer's cache (any format of `jaxinfer.kv`) with this
    step's keys and values already written. block_tables: i32[B, max_pages], row b's logical
    page j at pool page block_tables[b, j]. kv_lengths: i32[B], tokens cached per sequence.
    query_index: i32[B, T], each query's cache position: it sees keys at positions <= it (and
    within `window`, or among the first `num_sinks`); -1 marks a padding query, whose output
    is 0. slots: i32[B], each row's cache slot, required for KIVI (int4 / int2) caches, whose
    current page sits in a per-slot tail. `window`, `num_sinks`, `sink_logits` (f32[Hq], one
    extra logit per head in the softmax's denominator), `soft_cap` (cap * tanh(score / cap)) are
    the variants' masks. `impl`: "auto", "reference", "pallas", "pallas_gpu", "pallas_tpu"
    (module docstring). The decode kernels underneath take q [B, Hq, Dh] and one position
    per row; this entry takes every T and splits decode (T == 1) from chunked prefill."""
    target, interpret = resolve_impl(impl, q, layer_kv)
    if target is None:
        return paged_attention_reference(q, layer_kv, block_tables, kv_lengths, query_index, scale, window=window,
                                         num_sinks=num_sinks, sink_logits=sink_logits, soft_cap=soft_cap, slots=slots)
    from pallas_kernels.common import AttentionOptions
    from pallas_kernels.formats import from_layer_kv

    pages = from_layer_kv(own_layer(layer_kv))  # the kernels read a layer's own leaves: a view pays a copy
    if pages.k_tail is not None and slots is None:
        raise ValueError(f"the {pages.format!r} cache keeps its current page per slot: pass slots=")
    opts = AttentionOptions(window=window, num_sinks=num_sinks, soft_cap=soft_cap)
    args = dict(scale=scale, opts=opts, interpret=interpret)
    if target == "gpu" and gpu_kernel_family(pages, q.shape[2], q.shape[1] == 1, interpret) == "mosaic":
        target = "mosaic_gpu"
    if q.shape[1] == 1:
        decode = _kernel(target, "decode")
        out = decode(q[:, 0], pages, block_tables, kv_lengths, query_index[:, 0], sink_logits, slots, **args)
        return out[:, None]
    prefill = _kernel(target, "prefill")
    return prefill(q, pages, block_tables, kv_lengths, query_index, sink_logits, slots, **args)


def streaming_attention(
    q: jax.Array,  # [B, T, Hq, Dh]: queries, NOT rotated
    k_new: jax.Array,  # [B, T, Hkv, Dh]: this step's keys, NOT rotated
    v_new: jax.Array,  # [B, T, Hkv, Dh]
    layer_kv: LayerCache,  # the ring BEFORE this step's write
    block_tables: jax.Array,  # i32[B, max_pages]
    cached: jax.Array,  # i32[B]: tokens the sequence had seen before this step
    num_new: jax.Array,  # i32[B]
    streaming: StreamingSpec,
    inv_freq: jax.Array,  # f32[Dh/2]
    scale: float,
    *,
    window: int | None = None,
    impl: str = "auto",
) -> jax.Array:
    """StreamingLLM attention over a sink + recent-token ring -> [B, T, Hq, Dh] (reference only)."""
    require_reference(impl, "StreamingLLM ring attention")
    return streaming_attention_reference(q, k_new, v_new, layer_kv, block_tables, cached, num_new, streaming,
                                         inv_freq, scale, window=window)


def mla_attention(
    q_nope: jax.Array,  # [B, T, H, dn]
    q_rope: jax.Array,  # [B, T, H, dr]: rotated
    latent: LatentKV,  # this step's tokens already written
    w_uk: jax.Array,  # [H, dn, r]
    w_uv: jax.Array,  # [H, dv, r]
    block_tables: jax.Array,  # i32[B, max_pages]
    kv_lengths: jax.Array,  # i32[B]
    query_index: jax.Array,  # i32[B, T]
    scale: float,
    *,
    absorb: bool,
    impl: str = "auto",
) -> jax.Array:
    """DeepSeek MLA over the latent cache -> [B, T, H, dv]: absorbed decode (T == 1) by the MLA
    kernel of `impl`'s target, anything else (prefill, the expanded form) by the reference."""
    target, interpret = kernel_target(impl)
    if target is not None and absorb and q_nope.shape[1] == 1:
        reason = mla_unsupported_reason(latent, target, interpret)
        if reason is None:
            decode = _kernel(target, "mla_decode")
            latent = own_layer(latent)  # the kernel reads the layer's own pool: a view pays a copy
            # decode: each row's query sits at kv_lengths - 1 (query_index), as the kernels assume
            out_latent = decode(absorb_query(q_nope, w_uk)[:, 0], q_rope[:, 0], latent.c_kv, latent.k_rope,
                                block_tables, kv_lengths, scale=scale, interpret=interpret)  # f32[B, H, r]
            return expand_latent_output(out_latent[:, None], w_uv, q_nope.dtype)
        if impl != "auto":
            raise ValueError(f"attention_impl={impl!r}: {reason}")
    return mla_attention_reference(q_nope, q_rope, latent, w_uk, w_uv, block_tables, kv_lengths, query_index,
                                   scale, absorb=absorb)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention_impl={impl!r} must be one of {IMPLS}")


def require_reference(impl: str, variant: str) -> None:
    """Variants with no kernel: "auto" and "reference" run the reference, a kernel impl is an error."""
    check_impl(impl)
    if impl in KERNEL_IMPLS:
        raise ValueError(f"attention_impl={impl!r}: no Pallas kernel implements {variant}; "
                         "use attention_impl='reference' or 'auto'")


_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("target_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: str) -> Iterator[None]:
    """Trace attention as if for `platform` ("gpu" | "tpu") instead of this machine's backend:
    the kernels lowered for it (not interpreted) and "auto" choosing them, so
    `jax.export(..., platforms=["tpu" | "cuda"])` of code that calls the dispatch (a model's
    `forward`) holds the real kernels. Off the device, GPU programs take the Triton kernels
    (what runs before Hopper). Exporting for TPU also needs an abstract TPU device (the chip
    the Mosaic lowering targets) and for CUDA the Triton custom call's safety check disabled:
    see `pallas_kernels.lowering.lower` and the README's Pallas kernels section. `jax.jit`
    caches a trace by its arguments, not by this context: export a function not already
    traced outside it (a fresh `jax.jit`)."""
    if platform not in ("gpu", "tpu"):
        raise ValueError(f"platform={platform!r} must be 'gpu' or 'tpu'")
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def backend() -> str:
    """The platform programs compile for ("cpu" | "gpu" | "tpu"): jax's default backend, or the
    one `target_platform` names."""
    return _TARGET_PLATFORM.get() or jax.default_backend()


def kernels_by_default(impl: str) -> bool:
    """Does `impl` run the kernels on this backend where they apply ("auto" on GPU/TPU)?"""
    return impl == "auto" and backend() in ("gpu", "tpu")


def kernel_names(target: str | None = None) -> tuple[str, ...]:
    """The kernel names a target's compile errors show (default: this backend's): decode,
    chunked prefill, MLA decode (and on GPU the Mosaic GPU kernel)."""
    target = target or ("tpu" if backend() == "tpu" else "gpu")
    names = (f"paged_decode_{target}", f"chunked_prefill_{target}", f"mla_decode_{target}")
    return (*names, "paged_attention_mgpu") if target == "gpu" else names


def gpu_kernel_family(pages, q_heads: int, decode: bool, interpret: bool) -> str:
    """"mosaic" (Pallas Mosaic GPU: chunked prefill on a Hopper GPU, for the pages and heads its
    tiles take) or "triton" (decode, KIVI pages, everything else, and interpret mode on CPU).
    The Mosaic GPU kernel reads KIVI pages too, but only Triton's KIVI prefill has run on a device."""
    if decode or interpret or not hopper() or pages.is_kivi:
        return "triton"
    from pallas_kernels.paged_attention_mgpu import mgpu_supports

    return "mosaic" if mgpu_supports(pages, q_heads, decode=decode) else "triton"


def hopper() -> bool:
    """Is the default device a Hopper GPU (compute capability 9.x), what Mosaic GPU's wgmma needs?"""
    if _TARGET_PLATFORM.get() is not None:
        return False  # traced for a device this machine does not have
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def kernel_target(impl: str) -> tuple[str | None, bool]:
    """-> (the kernel target "gpu" | "tpu" `impl` asks for on this backend, or None for the
    reference; interpret mode?), whatever the variant."""
    check_impl(impl)
    platform = backend()
    if impl == "reference" or (impl == "auto" and platform not in ("gpu", "tpu")):
        return None, False
    target = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(impl, "tpu" if platform == "tpu" else "gpu")
    return target, platform != target


def resolve_impl(impl: str, q: jax.Array, layer_kv: LayerCache) -> tuple[str | None, bool]:
    """-> (kernel target "gpu" | "tpu", or None for the reference; interpret mode?)."""
    target, interpret = kernel_target(impl)
    if target is None:
        return None, False
    reason = unsupported_reason(q, layer_kv, target, interpret)
    if reason is None:
        return target, interpret
    if impl == "auto":
        return None, False
    raise ValueError(f"attention_impl={impl!r}: {reason}")


def unsupported_reason(q: jax.Array, layer_kv: LayerCache, target: str, interpret: bool) -> str | None:
    """Why the `target` ("gpu" | "tpu") kernels cannot take this cache and these shapes (None:
    they can). For "tpu" only the cache is checked: the Mosaic TPU lowering takes any shape its
    Python side accepts, and what libtpu then refuses is known only on a TPU."""
    if target not in ("gpu", "tpu"):
        raise ValueError(f"target={target!r} must be 'gpu' or 'tpu'")
    from pallas_kernels.formats import from_layer_kv

    try:
        pages = from_layer_kv(layer_kv)  # raises for caches no kernel reads
        pages = from_layer_kv(own_layer(layer_kv)) if layer_kv.layer is not None else pages  # a view's own layer
        pages.validate()
    except ValueError as err:
        return str(err)
    decode = q.shape[1] == 1
    if target == "gpu" and not interpret and decode and pages.is_kivi:
        return f"{pages.format} (KIVI) pages: {KIVI_TRITON_DECODE_CRASH}"
    if target == "gpu" and not interpret and gpu_kernel_family(pages, q.shape[2], decode, False) == "triton":
        from pallas_kernels.gpu_tiles import default_pages_per_block
        from pallas_kernels.paged_decode_gpu import check_triton_shapes

        try:
            check_triton_shapes(pages.page_size, q.shape[-1] // pages.parts, default_pages_per_block(pages.page_size, 1))
        except ValueError as err:
            return str(err)
    return None


def mla_unsupported_reason(latent: LatentKV, target: str, interpret: bool) -> str | None:
    """Why the `target` MLA kernel cannot take this latent cache (None: it can)."""
    if target == "gpu" and not interpret:
        from pallas_kernels.mla_decode_gpu import KEYS_PER_BLOCK, check_mla_triton_shapes

        page_size = latent.c_kv.shape[-2]
        try:
            check_mla_triton_shapes(page_size, latent.c_kv.shape[-1], latent.k_rope.shape[-1],
                                    max(1, KEYS_PER_BLOCK // page_size))
        except ValueError as err:
            return str(err)
    return None


def _kernel(target: str, kind: str):
    if (target, kind) == ("gpu", "mla_decode"):
        from pallas_kernels.mla_decode_gpu import mla_decode_gpu as fn
    elif (target, kind) == ("tpu", "mla_decode"):
        from pallas_kernels.mla_decode_tpu import mla_decode_tpu as fn
    elif target == "mosaic_gpu":
        from pallas_kernels.paged_attention_mgpu import chunked_prefill_mgpu, paged_decode_mgpu
        fn = paged_decode_mgpu if kind == "decode" else chunked_prefill_mgpu
    elif (target, kind) == ("gpu", "decode"):
        from pallas_kernels.paged_decode_gpu import paged_decode_gpu as fn
    elif (target, kind) == ("tpu", "decode"):
        from pallas_kernels.paged_decode_tpu import paged_decode_tpu as fn
    elif target == "gpu":
        from pallas_kernels.chunked_prefill_gpu import chunked_prefill_gpu as fn
    else:
        from pallas_kernels.chunked_prefill_tpu import chunked_prefill_tpu as fn
    return fn
