"""Runs of alike layers stacked along a leading axis, so the forward can `lax.scan` over depth.

A model's per-layer pytrees (its `LayerParams`, the paged cache's per-layer caches) come as a
tuple in one of two layouts::

    unrolled   (layer_0, layer_1, ..., layer_29)                 one pytree per layer
    stacked    (LayerStack(30 layers),)                          one pytree per run, every leaf [n, ...]
               (LayerStack(4), LayerStack(24), LayerStack(2))    e.g. a per-layer KV plan int8 / int4 / int8

A *run* is a stretch of consecutive layers the forward can treat as one loop body: the same
pytree class and static fields, the same leaf shapes and dtypes, the same attention window.
The forward unrolls the first layout and scans over each run of the second, so its program
grows with the number of runs, not with depth. Params and cache are stacked into the same runs
(`jaxinfer.model.stacking`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LayerStack:
    """`n` consecutive alike layers as one pytree of that layer's class, every leaf `[n, ...]`."""

    stacked: Any

    @property
    def n(self) -> int:
        return jax.tree.leaves(self.stacked)[0].shape[0]


Layers = tuple  # of per-layer pytrees, or of LayerStack runs (one layout per tuple)


def is_stacked(layers: Layers) -> bool:
    return any(isinstance(x, LayerStack) for x in layers)


def run_lengths(layers: Layers) -> tuple[int, ...]:
    """The layout of a layers tuple: a run's length per entry, 0 for an unrolled layer."""
    return tuple(x.n if isinstance(x, LayerStack) else 0 for x in layers)


def num_layers(layers: Layers) -> int:
    return sum(x.n if isinstance(x, LayerStack) else 1 for x in layers)


def signature(layer: Any) -> Hashable:
    """What must agree for two layers to share a loop body: pytree structure (class and static
    fields) and every leaf's shape and dtype."""
    leaves, treedef = jax.tree.flatten(layer)
    return treedef, tuple((jnp.shape(a), jnp.result_type(a)) for a in leaves)


def alike_runs(keys: Sequence[Hashable], split_at: Sequence[int] = ()) -> tuple[int, ...]:
    """Lengths of the maximal runs of equal consecutive `keys`, also cut before each index in `split_at`."""
    lengths: list[int] = []
    for i, key in enumerate(keys):
        if i and key == keys[i - 1] and i not in split_at:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return tuple(lengths)


def stack(layers: Layers, lengths: Sequence[int]) -> Layers:
    """Unrolled layers -> runs of `lengths` (summing to the layer count). Copies the arrays."""
    layers = unstack(layers)
    if sum(lengths) != len(layers):
        raise ValueError(f"runs {tuple(lengths)} do not cover the {len(layers)} layers")
    out, start = [], 0
    for n in lengths:
        run = layers[start : start + n]
        if len({signature(x) for x in run}) > 1:
            raise ValueError(f"layers {start}..{start + n - 1} differ in structure, shapes or dtypes: not one run")
        out.append(LayerStack(jax.tree.map(lambda *xs: jnp.stack(xs), *run)))
        start += n
    return tuple(out)


def unstack(layers: Layers) -> Layers:
    """Either layout -> unrolled (slices each run's leaves: copies, meant for setup and offline code)."""
    out = []
    for x in layers:
        if isinstance(x, LayerStack):
            out.extend(jax.tree.map(lambda a, i=i: a[i], x.stacked) for i in range(x.n))
        else:
            out.append(x)
    return tuple(out)


def slice_layers(layers: Layers, start: int, stop: int) -> Layers:
    """Layers [start, stop) in the layout they come in: whole runs are kept as they are (no
    copy); a run the range cuts is sliced."""
    out, first = [], 0
    for x in layers:
        n = x.n if isinstance(x, LayerStack) else 1
        lo, hi = max(start - first, 0), min(stop - first, n)
        if lo < hi:
            if not isinstance(x, LayerStack) or (lo, hi) == (0, n):
                out.append(x)
            else:
                out.append(LayerStack(jax.tree.map(lambda a: a[lo:hi], x.stacked)))
        first += n
    return tuple(out)


def map_layers(fn: Callable[[Any, bool], Any], layers: Layers) -> Layers:
    """`fn(layer, stacked)` applied to every entry (for a run: to its stacked pytree, the
    result stacked again), e.g. shardings that gain a leading axis for runs."""
    return tuple(LayerStack(fn(x.stacked, True)) if isinstance(x, LayerStack) else fn(x, False) for x in layers)


def entry_pytrees(layers: Layers) -> tuple[Any, ...]:
    """One representative layer per entry (a run's stacked pytree stands for its layers):
    enough to ask which classes or formats the layers use."""
    return tuple(x.stacked if isinstance(x, LayerStack) else x for x in layers)
