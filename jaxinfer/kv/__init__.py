"""Paged KV cache: device-side state and host-side page bookkeeping.

    pages.py          page addressing: KVCacheSpec, WriteIndices, NULL_PAGE, gathers/scatters
    formats.py        every storage format's quantize / dequantize math and byte accounting
    layer_cache.py    the LayerCache protocol every format implements; make_layer_kv
    dense.py, token_quant.py, kivi.py, latent.py    one module per format
    streaming.py      StreamingLLM rings (sinks + recent window)
    paged_state.py    PagedKVState (all layers + block tables + lengths), init_paged_kv, write_indices
    plan.py           per-layer format plans (measured and chosen by `jaxinfer.calibration`)
    allocator.py, prefix_cache.py, footprint.py, mesh_layout.py    host bookkeeping and layout
"""

from jaxinfer.kv.allocator import OutOfPagesError, PageAllocator, check_replica_pages, partition_pages
from jaxinfer.kv.dense import LayerKV
from jaxinfer.kv.footprint import kv_bytes_per_token
from jaxinfer.kv.formats import FORMAT_NAMES, QUANTIZED_FORMATS
from jaxinfer.kv.kivi import KiviLayerKV
from jaxinfer.kv.latent import LatentKV
from jaxinfer.kv.layer_cache import LayerCache, make_layer_kv
from jaxinfer.kv.pages import NULL_PAGE, KVCacheSpec, block_table_array
from jaxinfer.kv.paged_state import PagedKVState, init_paged_kv
from jaxinfer.kv.plan import KVCachePlan
from jaxinfer.kv.streaming import StreamingSpec
from jaxinfer.kv.token_quant import TokenQuantLayerKV

__all__ = [
    "FORMAT_NAMES",
    "NULL_PAGE",
    "QUANTIZED_FORMATS",
    "KVCachePlan",
    "KVCacheSpec",
    "KiviLayerKV",
    "LatentKV",
    "LayerCache",
    "LayerKV",
    "OutOfPagesError",
    "PageAllocator",
    "PagedKVState",
    "StreamingSpec",
    "TokenQuantLayerKV",
    "block_table_array",
    "check_replica_pages",
    "init_paged_kv",
    "kv_bytes_per_token",
    "make_layer_kv",
    "partition_pages",
]
