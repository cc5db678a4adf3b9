"""Write this step's K/V into the pages, then attend: on one device, or per device on a mesh.

On a ("data", "model") mesh the page pool is split over both axes: pages over `data`
(replica r holds pages [r * P/D, (r + 1) * P/D), the range the host allocator gives r's
slots: `jaxinfer.kv.allocator.partition_pages`) and KV heads over `model`. GSPMD cannot
split a gather through block tables (nor a Pallas call) by itself, so here the writes and
the attention (`jaxinfer.attention.dispatch`, kernels included) run under `jax.shard_map`,
each device on its own pages and heads::

    group by replica ([B, T], B % D == 0)    rows split over data: replica r takes block r,
                                             rows of its own slots (the decode group, row b =
                                             slot b; the engine's prefill rows)
    shared group ([B, T])                    every replica takes every row, works on the rows
                                             whose slot it owns, zeros the rest; a psum over
                                             data assembles the output (x + 0 is exact)
    page id g, in replica r                  local id g - r * P/D (others dropped / clipped)

The stored KV heads are split over `model`, each device attending with the query heads that
read them. With fewer KV heads than `model` devices the engine's pool keeps every KV head
`jaxinfer.kv.mesh_layout.kv_head_copies` times (the forward repeats K/V to match), so this still
holds: on model=8 with 4 KV heads and 8 query heads, device j stores a copy of KV head j // 2
and attends with query head j. (A pool without copies whose heads do not divide is
replicated over `model`, and every model device then attends with all query heads.)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.kv.layer_cache import LayerCache
from jaxinfer.kv.mesh_layout import page_spec
from jaxinfer.kv.pages import WriteIndices

# attend(q [B, T, Hq, Dh], layer_kv, idx) -> [B, T, Hq, Dh]
Attend = Callable[[jax.Array, LayerCache, WriteIndices], jax.Array]


def write_and_attend(layer_kv: LayerCache, qs: list[jax.Array], ks: list[jax.Array], vs: list[jax.Array],
                     idxs: list[WriteIndices], attend: Attend) -> tuple[list[jax.Array], LayerCache]:
    """All groups' writes first (groups are distinct slots), then attention per group."""
    for k, v, idx in zip(ks, vs, idxs):
        layer_kv = layer_kv.write(k, v, idx)
    return [attend(q, layer_kv, idx) for q, idx in zip(qs, idxs)], layer_kv


def sharded_write_and_attend(mesh, layer_kv: LayerCache, qs: list[jax.Array], ks: list[jax.Array], vs: list[jax.Array],
                             idxs: list[WriteIndices], by_replica: tuple[bool, ...], attend: Attend,
                             max_slots: int) -> tuple[list[jax.Array], LayerCache]:
    """`write_and_attend` under `jax.shard_map` over `mesh` (see the module docstring), for a
    cache whose `splits_over_mesh` is True (every leaf `[num_pages, page_size, heads, ...]`).

    `by_replica[g]`: group g's rows come in `data` equal blocks, block r of replica r's
    slots, and split over `data`; other groups are shared by every replica.
    """
    data = mesh.shape["data"]
    spec = page_spec(ks[0].shape[2], mesh)  # [P, page, heads, ...]: pages on data, stored heads on model
    heads = spec[2]
    lead = () if layer_kv.layer is None else (None,)  # a view into a run: leaves [L, P, ...], `layer` i32[]
    pages_per_replica = jax.tree.leaves(layer_kv)[0].shape[len(lead)] // data
    slots_per_replica = max_slots // data
    kv_spec = jax.tree.map(lambda a: P(*lead, *spec) if a.ndim else P(), layer_kv)
    rows = ["data" if s else None for s in by_replica]
    row_spec = lambda r, tree: jax.tree.map(lambda a: P(r, *[None] * (a.ndim - 1)), tree)  # noqa: E731
    head_spec = [P(r, None, heads, None) for r in rows]

    def local(layer_kv, qs, ks, vs, idxs):
        replica = jax.lax.axis_index("data")
        first = replica * pages_per_replica
        owned = [None if s else idx.slots // slots_per_replica == replica for s, idx in zip(by_replica, idxs)]
        idxs = [_localize(idx, first, pages_per_replica, o) for idx, o in zip(idxs, owned)]
        outs, layer_kv = write_and_attend(layer_kv, qs, ks, vs, idxs, attend)
        outs = [out if o is None else jax.lax.psum(jnp.where(o[:, None, None, None], out, 0), "data")
                for out, o in zip(outs, owned)]
        return outs, layer_kv

    fn = jax.shard_map(local, mesh=mesh, in_specs=(kv_spec, head_spec, head_spec, head_spec,
                                                   [row_spec(r, i) for r, i in zip(rows, idxs)]),
                       out_specs=(head_spec, kv_spec), check_vma=False)
    return fn(layer_kv, list(qs), list(ks), list(vs), list(idxs))


def _localize(idx: WriteIndices, first: jax.Array, num_local: int, owned: jax.Array | None) -> WriteIndices:
    """Global page ids -> this replica's: writes outside its range (or of rows it does not
    own) are dropped; block-table entries are clipped into range (reads past a row's length
    are masked anyway, and a row it does not own is zeroed)."""
    page_ids = idx.page_ids - first
    keep = (page_ids >= 0) & (page_ids < num_local)
    if owned is not None:
        keep &= owned[:, None]
    return dataclasses.replace(idx, page_ids=jnp.where(keep, page_ids, num_local),
                               block_tables=jnp.clip(idx.block_tables - first, 0, num_local - 1))
