"""Paged KV cache: device-side state and host-side page bookkeeping."""

from jaxinfer.kv.allocator import OutOfPagesError, PageAllocator, partition_pages
from jaxinfer.kv.footprint import kv_bytes_per_token
from jaxinfer.kv.formats import FORMAT_NAMES, QUANTIZED_FORMATS
from jaxinfer.kv.latent import LatentKV
from jaxinfer.kv.paged_state import (
    NULL_PAGE,
    KVCacheSpec,
    LayerKV,
    PagedKVState,
    block_table_array,
    init_paged_kv,
)
from jaxinfer.kv.plan import KVCachePlan
from jaxinfer.kv.streaming import StreamingSpec

__all__ = [
    "FORMAT_NAMES",
    "NULL_PAGE",
    "QUANTIZED_FORMATS",
    "KVCachePlan",
    "KVCacheSpec",
    "LatentKV",
    "LayerKV",
    "OutOfPagesError",
    "PageAllocator",
    "PagedKVState",
    "StreamingSpec",
    "block_table_array",
    "init_paged_kv",
    "kv_bytes_per_token",
    "partition_pages",
]
