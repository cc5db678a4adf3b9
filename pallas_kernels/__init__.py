"""Pallas kernels for paged and quantized attention (GPU and TPU).

They depend on jax and the cache formats (`jaxinfer.kv`) only, never on the model: the model
reaches them through `jaxinfer.attention.dispatch`, and they are tested against the jnp
references, `jaxinfer.attention.reference.paged_attention_reference` (and
`mla_attention_reference` for the MLA kernels).

    paged_attention_mgpu.py decode and chunked prefill,       Pallas Mosaic GPU (Hopper: TMA, wgmma)
                            dense bf16/f16, int8, fp8
    mgpu_interpret.py       jax's GPU interpret mode, with the transposed wgmma operand the above needs
    paged_decode_gpu.py     decode, any cache format          Pallas Triton lowering (other GPUs, formats)
    chunked_prefill_gpu.py  chunk of queries, any format      Pallas Triton lowering
    paged_decode_tpu.py     decode, any cache format          Pallas Mosaic TPU, scalar prefetch
    chunked_prefill_tpu.py  chunk of queries, any format      Pallas Mosaic TPU, scalar prefetch
    mla_decode_gpu.py       MLA absorbed decode, latent cache Pallas Triton lowering
    mla_decode_tpu.py       MLA absorbed decode, latent cache Pallas Mosaic TPU, scalar prefetch
    common.py               masks, page schedule, online softmax (shared math)
    formats.py              KernelPages: a cache layer as the kernels read it; in-tile dequantization
    gpu_tiles.py / tpu_tiles.py   the page walks of each target
    lowering.py             every kernel exported for TPU v5e / v6e and CUDA, Triton and Mosaic GPU
                            (jax.export), from any machine
    traffic.py              bytes a decode kernel moves per decoded token vs what the cache must supply

Import-light: the names below are loaded on first use, so `import pallas_kernels` pulls in no
Pallas; import the kernels from their modules (`from pallas_kernels.paged_decode_gpu import
paged_decode_gpu`).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AttentionOptions": "pallas_kernels.common",
    "KernelPages": "pallas_kernels.formats",
    "from_layer_kv": "pallas_kernels.formats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
