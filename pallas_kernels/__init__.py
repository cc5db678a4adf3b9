"""Pallas kernels for paged and quantized attention (GPU and TPU), checked against the jnp reference.

    paged_decode_gpu.py     decode, any cache format          Pallas Triton lowering
    chunked_prefill_gpu.py  chunk of queries, any format      Pallas Triton lowering
    paged_decode_tpu.py     decode, any cache format          Pallas Mosaic TPU, scalar prefetch
    chunked_prefill_tpu.py  chunk of queries, any format      Pallas Mosaic TPU, scalar prefetch
    reference.py            the per-sequence jnp reference they are tested against
    common.py               masks, page schedule, online softmax (shared math)
    formats.py              KernelPages: a cache layer as the kernels read it; in-tile dequantization
    gpu_tiles.py / tpu_tiles.py   the page walks of each target
    dispatch.py             paged_attention(..., impl="auto" | "reference" | "pallas")

Import-light: the names below are loaded on first use, so `import pallas_kernels` pulls in no
Pallas; import the kernels from their modules (`from pallas_kernels.paged_decode_gpu import
paged_decode_gpu`).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "paged_attention": "pallas_kernels.dispatch",
    "IMPLS": "pallas_kernels.dispatch",
    "AttentionOptions": "pallas_kernels.common",
    "KernelPages": "pallas_kernels.formats",
    "from_layer_kv": "pallas_kernels.formats",
    "paged_attention_per_sequence": "pallas_kernels.reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
