"""Meshes and shardings: tensor parallelism on `model`, data parallelism on `data`.

Everything here is plain `jax.sharding` (a `Mesh` with axes ``("data", "model")`` and
`NamedSharding`s); the partitioning itself is XLA's (GSPMD): the engine's one jitted step
runs unchanged, jitted with the explicit in/out shardings below.

    mesh = make_mesh("data=2,model=4")            # 8 devices
    engine = Engine(model, EngineConfig(mesh=mesh))

Layout on a ``data=D, model=M`` mesh (weights are ``[out, in]``)::

    wq, bq        [H*Dh, d]    rows split on model    (H % M == 0 is required)
    wk, wv, bk... [Hkv*Dh, d]  rows split on model    when Hkv % M == 0, else replicated
    wo            [d, H*Dh]    columns split on model
    w_gate, w_up  [ffn, d]     rows split on model    (ffn % M == 0 is required)
    w_down        [d, ffn]     columns split on model
    embed/lm_head [V, d]       rows (vocab) split on model when V % M == 0
    norms                      replicated
    KV pages      [P, page, Hkv*r, Dh]  pages split on data, heads on model; r = kv_head_copies:
                               1 when Hkv % M == 0, else each KV head kept r times so
                               every model device holds the KV heads its query heads read
    ring pages    [Pw, page, Hkv*r, Dh] a hybrid model's windowed layers (`jaxinfer.kv.window_ring`):
                               the same split; replica r's slots' rings in its share
    step inputs   [max_slots, ...] per slot, [rows, ...] prefill rows (block r: replica r's)
                               split on data (max_slots % D == 0 is required)

The page pool is divided over `data`: replica r's devices hold pages [r * P/D, (r+1) * P/D),
and the host allocator gives r's slots (r * max_slots/D ...) pages from that range only
(`jaxinfer.kv.allocator.partition_pages`). The paged writes and attention run per device
under `jax.shard_map` (`jaxinfer.attention.mesh`), the Pallas kernels included, so
no page crosses a device; the dense layers are left to GSPMD.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxinfer import layer_stack
from jaxinfer.config import ModelConfig
from jaxinfer.kv.layer_cache import stored_kv_heads
from jaxinfer.kv.mesh_layout import kv_head_copies, kv_heads_axis, page_spec  # noqa: F401 (re-exported)

AXES = ("data", "model")
_SPEC_ITEM = re.compile(r"^\s*(\w+)\s*=\s*(\d+)\s*$")


# ---- meshes -------------------------------------------------------------------------------


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """"data=2,model=4" -> {"data": 2, "model": 4}; a missing axis has size 1.

    Raises ValueError naming the bad item or axis (only "data" and "model" exist).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh spec {spec!r} must look like 'data=2,model=4'")
    sizes: dict[str, int] = {}
    for item in spec.split(","):
        m = _SPEC_ITEM.match(item)
        if m is None:
            raise ValueError(f"mesh spec item {item!r} must look like 'model=4' (in {spec!r})")
        name, size = m.group(1), int(m.group(2))
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {spec!r}: the axes are {AXES}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} given twice in {spec!r}")
        if size < 1:
            raise ValueError(f"mesh axis {name}={size} must be >= 1")
        sizes[name] = size
    return {a: sizes.get(a, 1) for a in AXES}


def make_mesh(spec: str | dict[str, int], devices: list | None = None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: every device of every process).

    The axis sizes must multiply to the number of devices. Axis types are `Auto`, so
    XLA propagates shardings through the unannotated model code.
    """
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) else dict(spec)
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}: the axes are {AXES}")
    shape = tuple(int(sizes.get(a, 1)) for a in AXES)
    devices = list(jax.devices() if devices is None else devices)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh data={shape[0]},model={shape[1]} needs {int(np.prod(shape))} devices, "
                         f"but {len(devices)} are available")
    auto = (AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, auto, devices=devices)


def check_mesh(mesh: Mesh, config: ModelConfig, max_slots: int | None = None) -> None:
    """Raise ValueError unless `config` (and `max_slots` engine slots) fit on `mesh`."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axis names {tuple(mesh.axis_names)} must be {AXES}")
    if any(kind != AxisType.Auto for kind in mesh.axis_types):  # jax.make_mesh's default is Explicit
        raise ValueError(f"mesh axis types {tuple(k.name for k in mesh.axis_types)} must be Auto: the engine's step is "
                         "partitioned by XLA from the weights' and cache's shardings; make the mesh with "
                         "jaxinfer.sharding.make_mesh, or jax.make_mesh(shape, names, "
                         "axis_types=(jax.sharding.AxisType.Auto,) * 2)")
    data, model = mesh.shape["data"], mesh.shape["model"]
    if config.n_heads % model:
        raise ValueError(f"n_heads={config.n_heads} is not divisible by the mesh's model={model} axis "
                         f"(tensor parallelism splits attention heads)")
    if config.ffn_dim % model:
        raise ValueError(f"ffn_dim={config.ffn_dim} is not divisible by the mesh's model={model} axis")
    if config.mla is not None and model > 1:
        raise ValueError(f"MLA models support only model=1 meshes for now (got model={model})")
    if max_slots is not None and max_slots % data:
        raise ValueError(f"max_slots={max_slots} is not divisible by the mesh's data={data} axis "
                         f"(data parallelism splits engine slots)")


# ---- parameter and cache shardings ----------------------------------------------------------


def _layer_specs(config: ModelConfig, mesh: Mesh) -> dict[str, P]:
    heads = kv_heads_axis(config.n_kv_heads, mesh)
    kv_rows, kv_bias = P(heads, None), P(heads)
    return {
        "wq": P("model", None), "bq": P("model"),
        "wk": kv_rows, "wv": kv_rows, "bk": kv_bias, "bv": kv_bias,
        "wo": P(None, "model"),
        "w_gate": P("model", None), "w_up": P("model", None), "w_down": P(None, "model"),
    }


def param_spec(name: str, config: ModelConfig, mesh: Mesh) -> P:
    """The `PartitionSpec` of the tensor `build_params` calls `name` ('embed', 'layers.3.wq', ...).

    Fields not in the table in this module's docstring (norms, MLA projections) are replicated.
    A run of layers stacked [n, ...] ('layers.4:30.wq') keeps its layer axis whole.
    """
    field = name.rsplit(".", 1)[-1]
    if field in ("embed", "lm_head"):
        return P("model", None) if config.vocab_size % mesh.shape["model"] == 0 else P()
    spec = _layer_specs(config, mesh).get(field, P())
    return P(None, *spec) if ":" in name else spec  # 'layers.4:30.wq': a run of layers stacked [n, ...]


def param_shardings(params: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """A pytree of `NamedSharding`s matching `params` (a ModelParams or its abstract twin).

    Pass the result to `load_orbax(..., shardings=...)` to restore each shard straight onto
    its devices.
    """
    check_mesh(mesh, config)

    def layer(lp, stacked: bool):
        name = "layers.0:1." if stacked else "layers.0."  # a stacked run's leaves gain a leading axis
        return type(lp)(**{
            f: None if getattr(lp, f) is None else NamedSharding(mesh, param_spec(name + f, config, mesh))
            for f in lp.__dataclass_fields__
        })

    return type(params)(
        embed=NamedSharding(mesh, param_spec("embed", config, mesh)),
        layers=layer_stack.map_layers(layer, params.layers),
        final_norm=NamedSharding(mesh, P()),
        lm_head=None if params.lm_head is None else NamedSharding(mesh, param_spec("lm_head", config, mesh)),
    )


def placer(mesh: Mesh) -> Callable[[ModelConfig, str, np.ndarray], jax.Array]:
    """`place` for `build_params` / `load_model`: each tensor goes straight into its shards
    on `mesh` as it is read, so each device receives only its slice (no full copy on one
    device; the host holds one tensor at a time besides what the file format keeps)."""
    def place(config: ModelConfig, name: str, array: np.ndarray) -> jax.Array:
        check_mesh(mesh, config)
        return put(array, NamedSharding(mesh, param_spec(name, config, mesh)))

    return place


def kv_shardings(kv: Any, mesh: Mesh) -> Any:
    """Shardings for a `PagedKVState` (any per-layer cache format).

    Page leaves (axis 0 = the pool) are split on `data`: a pool of P pages needs P % D == 0.
    Dense, int8 and fp8 pages (`[P, page, heads, ...]`, scales `[P, page, heads]`) also split
    their stored KV heads on `model` when they divide (a cache made with `kv_head_copies`
    always does). The windowed layers' ring pool of a hybrid model splits the same way (made
    with `window_replicas=D`, each replica's slots' rings lie in its share). Other leaves
    (KIVI's per-slot tails), the host-owned block tables and lengths and the ring tables are
    replicated. A stacked run's leaves (`jaxinfer.layer_stack`) keep their layer
    axis whole, as do stacked weights (`param_spec` of 'layers.{a}:{b}.{field}').
    """
    data = mesh.shape["data"]
    pools = {kv.num_pages} | ({kv.window_pool_pages} if kv.window_pool_pages else set())
    for pool in pools:
        if pool % data:
            raise ValueError(f"a pool of {pool} pages does not divide over the mesh's data={data} axis")

    def layer(layer_kv, stacked: bool) -> Any:
        lead = (None,) * stacked  # a stacked run's leaves are [n, ...]
        if layer_kv.splits_over_mesh:
            pages = NamedSharding(mesh, P(*lead, *page_spec(stored_kv_heads(layer_kv), mesh)))
            return jax.tree.map(lambda a: pages, layer_kv)
        return jax.tree.map(lambda a: NamedSharding(mesh, P(*lead, "data") if a.shape[stacked] in pools else P()),
                            layer_kv)

    return dataclasses.replace(kv, layers=layer_stack.map_layers(layer, kv.layers), block_tables=replicated(mesh),
                               lengths=replicated(mesh),
                               window_tables=None if kv.window_tables is None else replicated(mesh))


def by_replica(mesh: Mesh) -> NamedSharding:
    """Arrays whose leading axis is split by data replica ([max_slots, ...] per-slot arrays, a
    batch's prefill rows) on `data`; as a pytree prefix, every leaf of a batch."""
    return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put(tree: Any, shardings: Any) -> Any:
    """Place a pytree of host or single-device arrays onto `shardings`.

    Works in multi-process runs too: every process passes the same values and each
    builds only the shards its own devices hold (`jax.make_array_from_callback`); arrays
    already spread over several processes (`load_sharded`) move by `jax.device_put`.
    """
    def one(x, sharding):
        if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable):
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def shard_params(params: Any, config: ModelConfig, mesh: Mesh) -> Any:
    return put(params, param_shardings(params, config, mesh))


def load_sharded(path: str | os.PathLike | None, mesh: Mesh, dtype: str = "float32") -> Any:
    """`jaxinfer.loading.load_model` with the params placed on `mesh` -> a `Model`.

    No full copy of a tensor lands on one device first: an orbax directory (`jaxinfer
    convert`) restores every shard straight onto its devices; GGUF and HF tensors are put
    into their shards one by one as they are read (`placer`).
    """
    from pathlib import Path

    from jaxinfer import loading
    from jaxinfer.checkpoint.orbax_io import abstract_params, is_orbax_dir, load_orbax, read_orbax_config

    if path is None or not is_orbax_dir(path):
        return loading.load_model(path, dtype=dtype, progress=False, place=placer(mesh))
    config = read_orbax_config(Path(path).absolute()).replace(dtype=dtype)
    config, params = load_orbax(path, dtype, shardings=param_shardings(abstract_params(config), config, mesh))
    tokenizer = loading.tokenizer_of_dir(Path(path))
    if tokenizer is not None and not config.eos_ids and tokenizer.eos_ids:
        config = config.replace(eos_ids=tokenizer.eos_ids)
    return loading.Model(config=config, params=params, tokenizer=tokenizer, source=str(path),
                         generation_config=loading.sampling_defaults(path))


# ---- the engine's step on a mesh ------------------------------------------------------------


def shard_engine(model: Any, kv: Any, mesh: Mesh, max_slots: int, step: Callable
                 ) -> tuple[Any, Any, Callable, Callable]:
    """What `Engine` needs to run on `mesh`: (model with sharded params, sharded cache,
    the step jitted with explicit shardings, a function placing a `StepBatch`).

    The step is `step.__wrapped__` (the un-jitted `engine_step`) jitted again with explicit
    in and out shardings: params and cache as laid out here, every batch field split by
    replica on `data`; the cache comes back with its input shardings (so donation reuses its
    buffers and the next step compiles nothing new) and the sampled tokens come back
    replicated, so every process can read them. Inputs are placed before the call (`put`,
    which also builds global arrays across processes). Call it with every argument
    positional (jit refuses keywords next to in_shardings), `mesh` included.
    """
    check_mesh(mesh, model.config, max_slots)
    params = shard_params(model.params, model.config, mesh)
    kv_sh = kv_shardings(kv, mesh)
    # penalty histories (`jaxinfer.penalties`, per slot) are replicated, like the sampled tokens
    # they come back with
    fn = jax.jit(step.__wrapped__, static_argnames=("config", "attention_impl", "mesh"),
                 donate_argnames=("kv", "penalties"),
                 in_shardings=(shardings_of(params), kv_sh, by_replica(mesh), replicated(mesh)),
                 out_shardings=(kv_sh, replicated(mesh)))
    return (dataclasses.replace(model, params=params), put(kv, kv_sh), fn,
            lambda batch: place_slots(batch, mesh))


def shard_table_updates(mesh: Mesh, apply: Callable) -> tuple[Callable, Callable]:
    """The block-table update (`kv.table_updates.apply_table_updates`, passed in) on `mesh`:
    (it jitted with the tables and the updates replicated, as the cache keeps its tables, so
    the step that follows compiles nothing new; a function placing an update there)."""
    rep = replicated(mesh)
    fn = jax.jit(apply.__wrapped__, donate_argnums=0, in_shardings=(rep, rep), out_shardings=rep)
    return fn, lambda updates: put(updates, jax.tree.map(lambda _: rep, updates))


def shard_speculation(mesh: Mesh, params: Any, kv: Any, draft: Any, draft_kv: Any, draft_vocab: Any, step: Callable
                      ) -> tuple[Any, Any, Any, Callable]:
    """What speculative decoding needs on `mesh`, given the engine's params and cache `kv`
    already placed there: (draft with sharded params, its sharded cache, its vocab ids
    replicated, the speculative step jitted with explicit in and out shardings; call it with
    every argument positional, as `shard_engine`'s step).

    A separate draft model is laid out like the target (`param_spec`), its pages like the
    target's (split over `data` by the same page ids); a self-draft's params are the
    target's own (already sharded) and n-gram drafts have none.
    """
    draft_kv_sh = None
    if draft is not None and draft_kv is not None:
        check_mesh(mesh, draft.config)
        draft = dataclasses.replace(draft, params=shard_params(draft.params, draft.config, mesh))
        draft_kv_sh = kv_shardings(draft_kv, mesh)
        draft_kv = put(draft_kv, draft_kv_sh)
    if draft_vocab is not None:
        draft_vocab = put(draft_vocab, replicated(mesh))
    kv_sh = shardings_of(kv)
    # (params, kv, batch, drafts, draft_params, draft_vocab, draft_kv, penalties): None where
    # absent; penalties replicated, as in `shard_engine`
    fn = jax.jit(step.__wrapped__, static_argnames=("config", "draft_config", "shared_layers", "attention_impl", "mesh"),
                 donate_argnames=("kv", "draft_kv", "penalties"),
                 in_shardings=(shardings_of(params), kv_sh, by_replica(mesh), by_replica(mesh),
                               None if draft is None else shardings_of(draft.params),
                               None if draft_vocab is None else replicated(mesh), draft_kv_sh, replicated(mesh)),
                 out_shardings=(kv_sh, draft_kv_sh, replicated(mesh)))
    return draft, draft_kv, draft_vocab, fn


def shardings_of(tree: Any) -> Any:
    """The shardings a placed pytree of arrays has."""
    return jax.tree.map(lambda a: a.sharding, tree)


def place_slots(tree: Any, mesh: Mesh) -> Any:
    """Put a pytree of arrays split by data replica on `data`: per-slot arrays
    ([max_slots, ...]: a `DraftBatch`) and a `StepBatch` (its prefill rows too: the scheduler
    gives replica r row block r)."""
    return put(tree, jax.tree.map(lambda x: by_replica(mesh), tree))


# ---- several hosts --------------------------------------------------------------------------

ENV_COORDINATOR = "JAXINFER_COORDINATOR"  # host:port of process 0
ENV_NUM_PROCESSES = "JAXINFER_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXINFER_PROCESS_ID"


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids: list[int] | None = None,
                           timeout_s: int | None = None) -> bool:
    """Call `jax.distributed.initialize` from arguments or the JAXINFER_* environment.

    With no coordinator anywhere, nothing happens (returns False) unless `num_processes`
    is given: then `jax.distributed.initialize()` auto-detects the cluster (TPU pod slices,
    SLURM, Open MPI). Must run before anything touches a device. Returns True when called.
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if coordinator is None and num_processes is None:
        return False
    if coordinator is not None and (num_processes is None or process_id is None):
        raise ValueError(f"coordinator={coordinator!r} also needs num_processes and process_id "
                         f"(got {num_processes=}, {process_id=})")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"{process_id=} must be in [0, {num_processes=})")
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["initialization_timeout"] = timeout_s
    if coordinator is None:  # a cluster jax can detect by itself
        jax.distributed.initialize(**kwargs)
    else:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_device_ids, **kwargs)
    return True


def describe(tree: Any) -> str:
    """One line per leaf: name, shape and PartitionSpec (for notebooks and logs)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    lines = []
    for path, leaf in leaves:
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        lines.append(f"{jax.tree_util.keystr(path):40s} {str(tuple(leaf.shape)):22s} {spec}")
    return "\n".join(lines)
