"""Paged KV cache: device-side state and host-side page bookkeeping."""

from jaxinfer.kv.allocator import OutOfPagesError, PageAllocator
from jaxinfer.kv.paged_state import (
    NULL_PAGE,
    KVCacheSpec,
    LayerKV,
    PagedKVState,
    block_table_array,
    init_paged_kv,
)

__all__ = [
    "NULL_PAGE",
    "KVCacheSpec",
    "LayerKV",
    "OutOfPagesError",
    "PageAllocator",
    "PagedKVState",
    "block_table_array",
    "init_paged_kv",
]
