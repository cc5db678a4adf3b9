"""`paged_attention`: the reference's signature plus `impl`, choosing the jnp reference or a kernel.

    impl="reference"   jaxinfer.model.attention.paged_attention_reference
    impl="pallas"      the kernels of the backend: GPU (Triton-lowered) on GPU, TPU (Mosaic) on
                       TPU; on CPU the GPU-style kernels in interpret mode (slow: tests only)
    impl="pallas_gpu" / "pallas_tpu"   that target's kernels (interpret mode off their backend)
    impl="auto"        kernels on GPU/TPU when they take this cache and these shapes, else
                       the reference (always the reference on CPU)

Queries with T == 1 go to the decode kernel, longer chunks to the chunked-prefill kernel.
Every cache format of `jaxinfer.kv` with per-head K/V (dense, int8, fp8, int4/int2 KIVI) has
kernels; others (MLA's latent cache) only the reference ("pallas" raises ValueError).
"""

from __future__ import annotations

import jax

IMPLS = ("auto", "reference", "pallas", "pallas_gpu", "pallas_tpu")


def paged_attention(
    q: jax.Array,  # [B, T, Hq, Dh]: queries, already rotated
    layer_kv,  # one layer's cache (LayerKV, TokenQuantLayerKV, KiviLayerKV, ...)
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
    """Causal GQA attention through block tables -> [B, T, Hq, Dh] (dtype of q), by `impl`."""
    target, interpret = resolve_impl(impl, q, layer_kv)
    if target is None:
        return _reference(q, layer_kv, block_tables, kv_lengths, query_index, scale, window=window,
                          num_sinks=num_sinks, sink_logits=sink_logits, soft_cap=soft_cap, slots=slots)
    from pallas_kernels.common import AttentionOptions
    from pallas_kernels.formats import from_layer_kv

    pages = from_layer_kv(layer_kv)
    if pages.k_tail is not None and slots is None:
        raise ValueError(f"the {pages.format!r} cache keeps its current page per slot: pass slots=")
    opts = AttentionOptions(window=window, num_sinks=num_sinks, soft_cap=soft_cap)
    args = dict(scale=scale, opts=opts, interpret=interpret)
    if q.shape[1] == 1:
        decode = _kernel(target, "decode")
        out = decode(q[:, 0], pages, block_tables, kv_lengths, query_index[:, 0], sink_logits, slots, **args)
        return out[:, None]
    prefill = _kernel(target, "prefill")
    return prefill(q, pages, block_tables, kv_lengths, query_index, sink_logits, slots, **args)


def resolve_impl(impl: str, q: jax.Array, layer_kv) -> tuple[str | None, bool]:
    """-> (kernel target "gpu" | "tpu", or None for the reference; interpret mode?)."""
    if impl not in IMPLS:
        raise ValueError(f"attention_impl={impl!r} must be one of {IMPLS}")
    backend = jax.default_backend()
    if impl == "reference" or (impl == "auto" and backend not in ("gpu", "tpu")):
        return None, False
    target = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(impl, "tpu" if backend == "tpu" else "gpu")
    interpret = backend != target
    reason = unsupported_reason(q, layer_kv, target, interpret)
    if reason is None:
        return target, interpret
    if impl == "auto":
        return None, False
    raise ValueError(f"attention_impl={impl!r}: {reason}")


def unsupported_reason(q: jax.Array, layer_kv, target: str, interpret: bool) -> str | None:
    """Why the `target` kernels cannot take this cache and these shapes (None: they can)."""
    from pallas_kernels.formats import from_layer_kv

    try:
        pages = from_layer_kv(layer_kv)
        pages.validate()
    except ValueError as err:
        return str(err)
    if target == "gpu" and not interpret:
        from pallas_kernels.gpu_tiles import default_pages_per_block
        from pallas_kernels.paged_decode_gpu import check_triton_shapes

        try:
            check_triton_shapes(pages.page_size, q.shape[-1] // pages.parts, default_pages_per_block(pages.page_size, 1))
        except ValueError as err:
            return str(err)
    return None


def _kernel(target: str, kind: str):
    if (target, kind) == ("gpu", "decode"):
        from pallas_kernels.paged_decode_gpu import paged_decode_gpu as fn
    elif (target, kind) == ("tpu", "decode"):
        from pallas_kernels.paged_decode_tpu import paged_decode_tpu as fn
    elif target == "gpu":
        from pallas_kernels.chunked_prefill_gpu import chunked_prefill_gpu as fn
    else:
        from pallas_kernels.chunked_prefill_tpu import chunked_prefill_tpu as fn
    return fn


def _reference(q, layer_kv, block_tables, kv_lengths, query_index, scale, **options):
    from jaxinfer.model.attention import paged_attention_reference

    return paged_attention_reference(q, layer_kv, block_tables, kv_lengths, query_index, scale, **options)

