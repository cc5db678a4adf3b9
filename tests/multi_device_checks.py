"""Multi-device checks, run by tests/test_multi_device.py in a subprocess.

    python tests/multi_device_checks.py MODE [DEVICES]

sets XLA_FLAGS for DEVICES (default 8) simulated CPU devices *before* importing jax, runs
one group of checks and prints one JSON object as its last stdout line. Modes: `meshes`
(tiny models on (1, 8), (2, 4), (8, 1) + bad meshes), `meshes_more` (the variant, ring and
scan cases `meshes` leaves out: tests/multi_device_cases.py), `pmap`, `smollm` (the real
model, data-parallel), `distributed` (one process of a two-process run; reads JAXINFER_* env).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable

MODE = sys.argv[1]
DEVICES = int(sys.argv[2]) if len(sys.argv) > 2 else 8
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import sharding  # noqa: E402
from jaxinfer.engine import Engine, EngineConfig  # noqa: E402
from jaxinfer.kv import KVCacheSpec, block_table_array, init_paged_kv, partition_pages  # noqa: E402
from jaxinfer.loading import Model  # noqa: E402
from jaxinfer.model.transformer import forward  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402
from multi_device_cases import (DEFAULT_RINGS, DEFAULT_SCAN, DEFAULT_VARIANTS, MESHES, RINGS, SCAN,  # noqa: E402
                                VARIANTS)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3],
           [5], [6, 7], [8, 9, 10], [11, 40, 41, 42, 43, 44, 45, 46]]


def tiny() -> Model:
    from tiny_models import tiny_model

    config, params = tiny_model(n_heads=8, n_kv_heads=4)
    return Model(config, params, None)


def tiny_engine(model: Model, mesh, max_len: int = 16, **options) -> Engine:
    return Engine(model, EngineConfig(max_slots=8, page_size=4, max_model_len=max_len, prefill_chunk=8, mesh=mesh,
                                      **options))


def greedy(engine: Engine, prompts=PROMPTS, max_tokens: int = 6) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    return [list(o.token_ids) for o in outs]


def engine_tokens(model: Model, mesh, prompts=PROMPTS, max_tokens: int = 6, max_len: int = 16, **options) -> list[list[int]]:
    """Greedy tokens from the engine (one context bucket: 2 programs)."""
    return greedy(tiny_engine(model, mesh, max_len, **options), prompts, max_tokens)


def pages_layout(kv) -> dict:
    """Layer 0's K pages (any per-head format): global shape, PartitionSpec and the shape one device holds."""
    k = jax.tree.leaves(kv.layers[0])[0]
    return {"k_shape": list(k.shape), "k_spec": list(k.sharding.spec), "k_shard_shape": list(k.addressable_shards[0].data.shape)}


def first_logits(model: Model, mesh, prompts=PROMPTS) -> np.ndarray:
    """f32[len(prompts), V]: logits after each prompt, one `forward` over a sharded cache
    (slot b takes its pages from its data replica's part of the pool, as the engine's would)."""
    config, width = model.config, max(len(p) for p in prompts)
    data = 1 if mesh is None else mesh.shape["data"]
    slots = len(prompts)
    pps = -(-width // 4)
    spec = KVCacheSpec(num_pages=data * (slots // data * pps + 1), page_size=4, max_slots=slots, max_pages_per_seq=pps)
    parts = partition_pages(spec.num_pages, data)
    per_replica = slots // data
    copies = sharding.kv_head_copies(config.n_kv_heads, mesh)
    kv = init_paged_kv(config, spec, kv_head_copies=copies).replace(block_tables=jnp.asarray(block_table_array(
        [list(parts[b // per_replica][b % per_replica * pps:][:pps]) for b in range(slots)], pps)))
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    num_new = np.array([len(p) for p in prompts], np.int32)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    args = (tokens, positions, num_new, num_new - 1)
    if mesh is None:
        logits, _ = forward(model.params, config, jnp.asarray(tokens), jnp.asarray(positions), kv,
                            jnp.asarray(num_new), jnp.asarray(num_new - 1))
        return np.asarray(logits)
    params = sharding.shard_params(model.params, config, mesh)
    kv_sh = sharding.kv_shardings(kv, mesh)
    kv = sharding.put(kv, kv_sh)
    args = [sharding.put(a, sharding.by_replica(mesh)) for a in args]
    fn = jax.jit(forward, static_argnames=("config", "attention_impl", "mesh"),
                 out_shardings=(sharding.replicated(mesh), kv_sh))
    logits, _ = fn(params, config, args[0], args[1], kv, args[2], args[3], mesh=mesh)
    return np.asarray(logits)


def forward_with_a_foreign_page(model: Model) -> None:
    """The README's functional example on a data=2 mesh: slot 1's page 3 is replica 0's."""
    mesh = sharding.make_mesh("data=2,model=4")
    spec = KVCacheSpec(num_pages=16, page_size=4, max_slots=2, max_pages_per_seq=2)
    kv = init_paged_kv(model.config, spec).replace(block_tables=jnp.asarray(block_table_array([[1, 2], [3]], 2)))
    kv = sharding.put(kv, sharding.kv_shardings(kv, mesh))
    tokens = jnp.zeros((2, 1), jnp.int32)
    forward(sharding.shard_params(model.params, model.config, mesh), model.config, tokens, tokens, kv, mesh=mesh)


def error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def check_meshes() -> dict:
    model = tiny()
    ref_tokens, ref_logits = engine_tokens(model, None), first_logits(model, None)
    out: dict = {"ref_tokens": ref_tokens, "meshes": {}}
    for spec in MESHES:
        mesh = sharding.make_mesh(spec)
        engine = tiny_engine(model, mesh)
        out["meshes"][spec] = {
            "tokens": greedy(engine), "pages": pages_layout(engine.kv), "num_pages": engine.spec.num_pages,
            "max_logit_diff": float(np.abs(first_logits(model, mesh) - ref_logits).max()),
        }
    out["pool"] = check_pool_layout(model)
    out["kv_copies"] = check_kv_copies()
    mesh = sharding.make_mesh("data=2,model=4")
    out["pallas"] = {"tokens": engine_tokens(model, mesh, attention_impl="pallas")}
    out["kv_formats"] = {fmt: {"ref": engine_tokens(model, None, kv_cache=fmt), "mesh": engine_tokens(model, mesh, kv_cache=fmt)}
                         for fmt in ("int8", "int4")}
    out["speculative"] = {name: engine_tokens(model, mesh, speculative=sc) for name, sc in speculative_sources().items()}
    penalized = [SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.5, frequency_penalty=1.0,
                                logit_bias={3: 2.0}), SamplingParams(max_tokens=6, temperature=0)] * (len(PROMPTS) // 2 + 1)
    engines = {"ref": tiny_engine(model, None), "mesh": tiny_engine(model, mesh),
               "mesh_draft": tiny_engine(model, mesh, speculative=speculative_sources()["draft"])}
    out["penalties"] = {name: [list(o.token_ids) for o in e.generate(PROMPTS, penalized[:len(PROMPTS)])]
                        for name, e in engines.items()}
    out["variants"] = check_variants(DEFAULT_VARIANTS)
    out["rings"] = check_rings(DEFAULT_RINGS)
    out["scan"] = check_scan(model, mesh, DEFAULT_SCAN)
    out["orbax"] = check_orbax_restore(model)
    from tiny_models import tiny_model

    bad_config = tiny_model(n_heads=6, n_kv_heads=2)[0]
    out["gguf"] = check_gguf_placed()
    out["errors"] = {
        "heads": error_of(lambda: sharding.check_mesh(sharding.make_mesh("data=2,model=4"), bad_config)),
        "axis_name": error_of(lambda: sharding.make_mesh("batch=2,model=4")),
        "device_count": error_of(lambda: sharding.make_mesh("data=4,model=4")),
        "slots": error_of(lambda: Engine(model, EngineConfig(max_slots=6, mesh=sharding.make_mesh("data=8")))),
        "pages": error_of(lambda: Engine(model, EngineConfig(max_slots=8, num_pages=33, mesh=sharding.make_mesh("data=2,model=4")))),
        "engine_heads": error_of(lambda: Engine(Model(bad_config, tiny_model(n_heads=6, n_kv_heads=2)[1], None),
                                                EngineConfig(mesh=sharding.make_mesh("model=8")))),
        # meshes a user makes with jax itself: other axis names, jax.make_mesh's default Explicit axes
        "engine_axis_names": error_of(lambda: Engine(model, EngineConfig(mesh=jax.make_mesh((2, 4), ("dp", "tp"))))),
        "forward_replica_pages": error_of(lambda: forward_with_a_foreign_page(model)),
        "explicit_axes": error_of(lambda: Engine(model, EngineConfig(max_slots=8, mesh=jax.make_mesh(
            (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)))),
    }
    return out


def speculative_sources() -> dict:
    """n-gram, self-speculation over the first layer, a separate draft model (sharded like the target)."""
    from jaxinfer.speculative import DraftModel
    from jaxinfer.engine import SpeculativeConfig
    from tiny_models import tiny_model

    return {"ngram": SpeculativeConfig("ngram", 4), "self": SpeculativeConfig("self", 3, self_layers=1),
            "draft": SpeculativeConfig("draft", 4, draft=DraftModel(*tiny_model(seed=1, n_heads=8, n_kv_heads=4, n_layers=1)))}


def check_kv_copies() -> dict:
    """KV heads the model axis does not divide: 3 KV heads on model=2 (each kept twice, device j
    holding copies of heads {0, 0, 1} or {1, 2, 2}) and MQA on model=8 with int8 pages (the one
    head kept 8 times, its scales too): tokens as on one device."""
    from tiny_models import tiny_model

    cases = {"gqa3_model2": (6, 3, "data=4,model=2", {}), "mqa_model8_int8": (8, 1, "data=1,model=8", {"kv_cache": "int8"})}
    out = {}
    for name, (heads, kv_heads, spec, options) in cases.items():
        m = Model(*tiny_model(n_heads=heads, n_kv_heads=kv_heads), None)
        engine = tiny_engine(m, sharding.make_mesh(spec), **options)
        out[name] = {"ref": engine_tokens(m, None, **options), "mesh": greedy(engine), "pages": pages_layout(engine.kv),
                     "num_pages": engine.spec.num_pages}
    return out


def check_meshes_more() -> dict:
    """The variants, ring and scan cases `meshes` leaves to the extended tests."""
    model, mesh = tiny(), sharding.make_mesh("data=2,model=4")
    return {"variants": check_variants(set(VARIANTS) - set(DEFAULT_VARIANTS)),
            "rings": check_rings(set(RINGS) - set(DEFAULT_RINGS)),
            "scan": check_scan(model, mesh, set(SCAN) - set(DEFAULT_SCAN))}


def check_variants(names: Iterable[str]) -> dict:
    """Sliding windows (pages released behind the window, per replica), a StreamingLLM ring,
    MLA (latent pages, left to GSPMD; model=1 only) and gpt-oss layers (learned sinks,
    experts, YaRN) on meshes: tokens as on one device."""
    from test_attention_variants import mla_tiny_config
    from tiny_models import tiny_config

    from jaxinfer.config import MoEConfig, YarnRopeScaling
    from jaxinfer.model import init_random_params

    gpt_oss = tiny_config(arch="gpt_oss", attn_sinks=True, attn_bias=True, attn_out_bias=True, layer_windows=(6, None),
                          moe=MoEConfig(n_experts=4, experts_per_token=2, expert_dim=16),
                          rope_scaling=YarnRopeScaling(factor=4.0, original_max_position=32))
    cases = {"window": (tiny_config(layer_windows=(6, 6)), "data=2,model=4", {}),
             "gpt_oss": (gpt_oss, "data=2,model=4", {}),  # learned sinks split with the query heads
             "streaming": (tiny_config(), "data=2,model=4", {"streaming": (2, 6)}),
             "mla": (mla_tiny_config(), "data=8,model=1", {})}
    out = {}
    for name in names:
        config, spec, options = cases[name]
        m = Model(config, init_random_params(config, seed=0, scale=0.3), None)
        out[name] = {"ref": engine_tokens(m, None, **options), "mesh": engine_tokens(m, sharding.make_mesh(spec), **options)}
    return out


def check_rings(cases: Iterable[tuple[str, str]]) -> dict:
    """Hybrid models (a tiny Gemma-3-like and a gpt-oss-like one) whose windowed layers hold a
    ring of pages per slot (`jaxinfer.kv.window_ring`), on data=2,model=2 (4 of the 8 devices) and
    data=2,model=4 (2 KV heads kept twice): prompts and outputs past the window, then prompts
    hitting a cached 40-token prefix (recomputed for the rings: `Scheduler.hit_recompute`),
    tokens as on one device; each device holds its replica's half of the ring pool and its
    share of the heads."""
    from test_window_ring import GEMMA_TINY, GPT_OSS_TINY
    from tiny_models import tiny_config

    from jaxinfer.model import init_random_params

    configs = {"gemma3": tiny_config(**GEMMA_TINY), "gpt_oss": tiny_config(**GPT_OSS_TINY)}
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 97, 40).tolist()
    prompts = [shared + [1, 2]] + [rng.integers(0, 97, int(n)).tolist() for n in rng.integers(3, 30, 7)]
    hits = [shared + rng.integers(0, 97, int(n)).tolist() for n in (2, 5, 3, 6)]

    def both_rounds(engine: Engine) -> list[list[int]]:
        return greedy(engine, prompts, max_tokens=12) + greedy(engine, hits, max_tokens=12)

    out = {}
    for name, config in configs.items():
        specs = [spec for model_name, spec in cases if model_name == name]
        if not specs:
            continue
        m = Model(config, init_random_params(config, seed=0, scale=0.3), None)
        ref = both_rounds(tiny_engine(m, None, max_len=64))
        for spec in specs:
            devices = jax.devices()[:4] if spec == "data=2,model=2" else None
            engine = tiny_engine(m, sharding.make_mesh(spec, devices), max_len=64)
            tokens = both_rounds(engine)
            k = jax.tree.leaves(engine.kv.layers[0])[0]  # layer 0 is windowed: a ring pool
            out[f"{name} {spec}"] = {
                "ref": ref, "mesh": tokens, "window_ring": engine.window_ring, "prefix_hits": engine.metrics().prefix_hits,
                "ring_k_shape": list(k.shape), "ring_k_shard_shape": list(k.addressable_shards[0].data.shape),
                "ring_k_spec": list(k.sharding.spec)}
    return out


def check_scan(model: Model, mesh, names: Iterable[str]) -> dict:
    """Layers under `lax.scan` (stacked params and pages, a leading layer axis kept whole) on
    data=2,model=4: plain, int8 and int4 pages, self-speculation (a run ends at its layers)."""
    cases = {"plain": {}, "int8": {"kv_cache": "int8"}, "int4": {"kv_cache": "int4"},
             "self": {"speculative": speculative_sources()["self"]}}
    return {name: {"ref": engine_tokens(model, None, **cases[name]),
                   "mesh": engine_tokens(model, mesh, layer_loop="scan", **cases[name])} for name in names}


def check_pool_layout(model: Model) -> dict:
    """On data=2,model=4: each device holds half the pages and a quarter of the KV heads, and
    every running request's pages lie in its own replica's half of the pool; the compiled
    step declares its input shardings, the batch's prefill rows split by replica."""
    mesh = sharding.make_mesh("data=2,model=4")
    engine = Engine(model, EngineConfig(max_slots=8, page_size=4, max_model_len=16, prefill_chunk=8, mesh=mesh))
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=6, temperature=0))
    in_own_replica, replicas_used = True, set()
    s = engine.scheduler
    while engine.has_unfinished_requests():
        engine.step()
        for req in s.running:
            replicas_used.add(s.replica_of(req.slot))
            in_own_replica &= all(p in s.allocators[s.replica_of(req.slot)].pages for p in req.pages)
    batch = engine._place(engine._idle_batch(engine.context_buckets[0], True, engine.config.max_slots))
    m = engine.model
    params_in, kv_in, batch_in, _ = engine._step.lower(m.params, m.config, engine.kv, batch, "reference",
                                                       mesh, None).compile().input_shardings[0]
    return {"prefill_rows": int(batch.prefill.tokens.shape[0]),
            "prefill_in_spec": list(batch_in.prefill.tokens.spec), "k_in_spec": list(kv_in.layers[0].k.spec),
            "prefill_shard_shape": list(batch.prefill.tokens.addressable_shards[0].data.shape),
            "num_pages": engine.spec.num_pages, **pages_layout(engine.kv),
            "in_own_replica": bool(in_own_replica), "replicas_used": sorted(replicas_used)}


def check_orbax_restore(model: Model) -> dict:
    """Save the tiny model with orbax, restore it straight into data=2,model=4 shardings."""
    import tempfile

    from jaxinfer.checkpoint.orbax_io import save_orbax

    mesh = sharding.make_mesh("data=2,model=4")
    with tempfile.TemporaryDirectory() as tmp:
        save_orbax(model.config, model.params, f"{tmp}/ckpt")
        restored = sharding.load_sharded(f"{tmp}/ckpt", mesh)
    wq = restored.params.layers[0].wq
    return {"wq_spec": list(wq.sharding.spec), "wq_shard_shape": list(wq.addressable_shards[0].data.shape),
            "equal": all(bool(np.array_equal(np.asarray(a), np.asarray(b)))
                         for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(model.params)))}


def check_gguf_placed() -> dict:
    """A GGUF file loaded onto data=2,model=4: every tensor lands in its shards as it is read."""
    import tempfile
    from pathlib import Path

    from jaxinfer.loading import load_model
    from jaxinfer.model import init_random_params
    from test_checkpoint import flat, tiny_config, write_gguf

    config = tiny_config(n_heads=8, n_kv_heads=4, head_dim=8, d_model=64)
    mesh = sharding.make_mesh("data=2,model=4")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(Path(tmp) / "tiny.gguf", config, flat(init_random_params(config)))
        placed = sharding.load_sharded(path, mesh)
        plain = load_model(path, progress=False)
    wq, wk = placed.params.layers[0].wq, placed.params.layers[0].wk
    return {"wq_spec": list(wq.sharding.spec), "wq_shard_shape": list(wq.addressable_shards[0].data.shape),
            "wk_spec": list(wk.sharding.spec),
            "all_on_mesh": all(a.sharding.mesh.shape == mesh.shape for a in jax.tree.leaves(placed.params)),
            "equal": all(bool(np.array_equal(np.asarray(a), np.asarray(b)))
                         for a, b in zip(jax.tree.leaves(placed.params), jax.tree.leaves(plain.params)))}


def check_pmap() -> dict:
    from jaxinfer.pmap_generate import pmap_generate

    model = tiny()
    res = pmap_generate(model, PROMPTS[:7], max_tokens=6)  # 7 prompts on 8 devices: one padded
    return {"ref_tokens": engine_tokens(model, None, PROMPTS[:7]), "tokens": res.tokens,
            "max_logit_diff": float(np.abs(res.first_logits - first_logits(model, None, PROMPTS[:7])).max())}


def check_smollm() -> dict:
    from jaxinfer.loading import load_model

    model = load_model(progress=False)
    prompts = [[1, 504, 3458, 314, 253]] + [[1, 40, 1513 + i] for i in range(7)]
    mesh = sharding.make_mesh("data=8,model=1")
    ref = first_logits(model, None, prompts)  # one device, all 8 prompts in one batch
    # one device, one prompt at a time: the shapes each data replica computes on
    per_row = np.concatenate([first_logits(model, None, [p]) for p in prompts])
    sharded = first_logits(model, mesh, prompts)
    return {"ref_tokens": engine_tokens(model, None, prompts, max_tokens=3, max_len=16),
            "tokens": engine_tokens(model, mesh, prompts, max_tokens=3, max_len=16),
            "max_logit_diff": float(np.abs(sharded - ref).max()),
            "max_logit_diff_same_shapes": float(np.abs(sharded - per_row).max()),
            "batch_vs_per_row_one_device": float(np.abs(per_row - ref).max()),
            "max_abs_logit": float(np.abs(ref).max())}


def check_distributed() -> dict:
    """One process of two: process 0 schedules (generate), process 1 follows its engine."""
    sharding.initialize_distributed(timeout_s=60)
    model = tiny()
    mesh = sharding.make_mesh("data=2,model=4")  # spans both processes' devices
    out = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count()}
    engine = tiny_engine(model, mesh)
    if jax.process_index() == 0:
        try:  # with logprobs too: their program is a second kind of step the follower must join
            outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, logprobs=2))
        finally:
            engine.close()
        out["tokens"] = [list(o.token_ids) for o in outs]
    else:
        try:
            engine.add_request([1, 2, 3])
        except RuntimeError as e:
            out["add_request_error"] = str(e)
        engine.follow()
        out["followed_steps"] = engine._channel._received
    out["logits"] = first_logits(model, mesh)
    if jax.process_index() == 0:  # the single-device reference, on this process's first device
        out["ref_tokens"] = engine_tokens(model, None)
        out["max_logit_diff"] = float(np.abs(out["logits"] - first_logits(model, None)).max())
    del out["logits"]
    return out


if __name__ == "__main__":
    result = {"meshes": check_meshes, "meshes_more": check_meshes_more, "pmap": check_pmap, "smollm": check_smollm,
              "distributed": check_distributed}[MODE]()
    print(json.dumps(result))
