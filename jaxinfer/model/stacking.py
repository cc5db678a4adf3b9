"""The stacked layer layout: which layers form runs, and params in that layout.

`forward` follows the layout it is given (`jaxinfer.layer_stack`): per-layer tuples unroll the
layers into the program; runs of alike layers stacked along a leading axis run as one
`lax.scan` each, so the program (and its compile time) stops growing with depth. Which is
faster to run depends on the backend (`resolve_layer_loop`)::

    runs = layer_runs(config, kv_cache="int8")                       # e.g. (30,)
    params = with_layer_runs(params, runs)
    kv = init_paged_kv(config, spec, kv_cache="int8", layer_runs=runs)
    logits, kv = forward(params, config, tokens, positions, kv)      # scans
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer import layer_stack
from jaxinfer.config import ModelConfig
from jaxinfer.kv.plan import KVCacheArg, resolve_kv_cache
from jaxinfer.model.params import GEMM_GROUPS, LayerParams, MLALayerParams, ModelParams, gemm_weights, lm_head_weight

LAYER_LOOPS = ("auto", "scan", "unroll")
WEIGHT_LAYOUTS = ("auto", "one", "all")
AUTO_COPIES_LIMIT = 2 * 2**30  # bytes of weight copies "auto" adds at most


def resolve_layer_loop(layer_loop: str, backend: str | None = None) -> str:
    """"auto" -> "unroll" on XLA:CPU, where unrolled layers decode faster, "scan" elsewhere
    (GPU/TPU: a program per run of layers, not per layer)."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop={layer_loop!r} must be one of {LAYER_LOOPS}")
    if layer_loop != "auto":
        return layer_loop
    return "unroll" if (backend or jax.default_backend()) == "cpu" else "scan"


def resolve_weight_layouts(weight_layouts: str, params, mesh=None, backend: str | None = None) -> str:
    """"auto" -> "all" (`jaxinfer.model.params.with_gemm_weights`) on one XLA:CPU device when
    the two extra copies of the dense layers' weights and the LM head (and the grouped copies
    of q/k/v and gate/up) take at most 2 GiB; "one" otherwise
    (GPU/TPU GEMMs read the checkpoint's layout at full speed)."""
    if weight_layouts not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layouts={weight_layouts!r} must be one of {WEIGHT_LAYOUTS}")
    if weight_layouts != "auto":
        return weight_layouts
    if mesh is not None or (backend or jax.default_backend()) != "cpu":
        return "one"
    dense = [gemm_weights(x) for x in jax.tree.leaves(params.layers, is_leaf=_is_layer)]
    copied = lm_head_weight(params).nbytes + sum(w.nbytes for ws in dense for w in ws.values())
    grouped = sum(ws[name].nbytes for ws in dense for names in GEMM_GROUPS for name in names if name in ws)
    return "all" if 2 * copied + grouped <= AUTO_COPIES_LIMIT else "one"


def _is_layer(x) -> bool:
    return isinstance(x, (LayerParams, MLALayerParams))


def layer_runs(config: ModelConfig, kv_cache: KVCacheArg = "auto", split_at: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Lengths of the runs of consecutive layers that share a loop body: the same KV-cache
    format and attention window (params have one class and shape per config), also cut before
    each layer in `split_at` (e.g. where a self-draft's shared layers end)."""
    formats = resolve_kv_cache(kv_cache, config.n_layers, config.dtype)
    return layer_stack.alike_runs([(formats[i], config.window(i)) for i in range(config.n_layers)], split_at)


def with_layer_runs(params: ModelParams, runs: tuple[int, ...] | None) -> ModelParams:
    """`params` with their layers stacked into `runs`, or unrolled (`runs` None); returned as
    they are when already so. A change of layout copies the layer weights."""
    if layer_stack.run_lengths(params.layers) == (tuple(runs) if runs else (0,) * len(params.layers)):
        return params
    layers = layer_stack.unstack(params.layers) if runs is None else layer_stack.stack(params.layers, runs)
    return dataclasses.replace(params, layers=layers)
