"""Where a page pool lives on a ("data", "model") mesh: pages over `data`, KV heads over `model`.

The forward's per-device writes and attention (`jaxinfer.attention.mesh`) and the engine's
shardings (`jaxinfer.sharding`) both read the layout from here.
"""

from __future__ import annotations

import math

from jax.sharding import Mesh, PartitionSpec as P


def kv_heads_axis(n_kv_heads: int, mesh: Mesh) -> str | None:
    """KV heads are split on `model` when they divide evenly (-> "model"), else replicated (None)."""
    return "model" if n_kv_heads % mesh.shape["model"] == 0 else None


def kv_head_copies(n_kv_heads: int, mesh: Mesh | None) -> int:
    """How many times the page pool keeps each KV head so its heads split evenly over `model`.

    With fewer KV heads than `model` devices (GQA/MQA on a wide `model` axis) the pages would
    otherwise be replicated, and every device would attend with every query head. Keeping
    each head r = M / gcd(Hkv, M) times (vLLM does the same) lets device j hold only the copies
    its own query heads read (r divides the GQA group whenever n_heads % M == 0), so the
    attention splits over `model` and each device's pages shrink to Hkv / gcd(Hkv, M) heads.
    """
    model = 1 if mesh is None else mesh.shape["model"]
    return model // math.gcd(n_kv_heads, model)


def page_spec(stored_heads: int, mesh: Mesh) -> P:
    """A `[num_pages, page_size, heads, ...]` cache leaf: pages on `data`, the stored KV heads
    (copies included) on `model` when they divide, else replicated."""
    return P("data", None, kv_heads_axis(stored_heads, mesh))
