"""The engine on a `jax.sharding` mesh of 8 simulated CPU devices, side by side with one device.

A random llama-style model (d_model 256, 4 layers, 8 heads, 4 KV heads, head_dim 32, ffn 512,
vocab 1024, f32) runs on one device (mesh=None) and on the meshes "data=8,model=1",
"data=2,model=4" and "data=1,model=8". On a mesh the KV page pool is divided over `data`
(each data replica's devices hold num_pages / D pages) and KV heads over `model`; params are
split over `model`. For each mesh this reports:

  * KV bytes per device: the max over devices of the bytes of every addressable shard of every
    `engine.kv` leaf on that device (pages, plus the small block tables), and its ratio to the
    one-device total; the same for `engine.model.params`;
  * whether greedy output tokens equal the one-device run (`--prompts` random prompts of
    `--prompt-tokens` ids, `--new-tokens` new tokens each);
  * decode throughput: (new tokens - 1) * prompts / (time(generate N) - time(generate 1)),
    after `engine.warmup()`, best of `--repeats`, and its ratio to one device;
  * FLOPs per device of one engine step (XLA's cost analysis of the compiled per-device
    program, longest context bucket), decode-only and with the 8 prefill rows of 64 tokens,
    and their ratios to one device: on data=D each replica should prefill only its own rows.

All meshes use the same `num_pages` (a multiple of 8) and 8 prefill rows per step, so ratios
compare like with like.
The 8 simulated devices share this machine's CPU cores: throughput ratios measure the
overhead of partitioning (collectives, per-device dispatch), not a speedup.
Last stdout line: one JSON object.

    python benchmarks/multi_device.py [--prompts 16] [--new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import sharding  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.engine import Engine, EngineConfig  # noqa: E402
from jaxinfer.loading import Model  # noqa: E402
from jaxinfer.model import init_random_params  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402

MESHES = [None, "data=8,model=1", "data=2,model=4", "data=1,model=8"]
SHORT = {None: "1dev", "data=8,model=1": "d8", "data=2,model=4": "d2m4", "data=1,model=8": "m8"}


def make_model(args: argparse.Namespace) -> Model:
    config = ModelConfig(arch="llama", vocab_size=1024, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                         head_dim=32, ffn_dim=512, rope_theta=10000.0, max_position=max(256, args.max_model_len))
    return Model(config, init_random_params(config, seed=0, scale=0.3), None)


def bytes_per_device(tree) -> tuple[int, int]:
    """(max over devices of the bytes of the shards it holds, total bytes of the logical arrays)."""
    per_device: dict = defaultdict(int)
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values()), total


def step_flops(engine: Engine, with_prefill: bool) -> float:
    """FLOPs of the compiled per-device program of one step at the longest context bucket."""
    m, mesh = engine.model, engine.config.mesh
    batch = engine._place(engine._idle_batch(engine.context_buckets[-1], with_prefill, engine.config.max_slots))
    compiled = engine._step.lower(m.params, m.config, engine.kv, batch, "reference", mesh).compile()  # positional: see shard_engine
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def run_mesh(model: Model, mesh_spec: str | None, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    mesh = None if mesh_spec is None else sharding.make_mesh(mesh_spec)
    engine = Engine(model, EngineConfig(max_slots=8, page_size=16, max_model_len=args.max_model_len,
                                        prefill_chunk=64, max_prefill_rows=8, num_pages=args.num_pages, mesh=mesh,
                                        enable_prefix_caching=False))
    t0 = time.perf_counter()
    engine.warmup()

    def run(n: int) -> tuple[float, list[list[int]]]:
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t, [list(o.token_ids) for o in outs]

    _, tokens = run(args.new_tokens)  # also compiles anything warmup did not
    _, _ = run(1)
    warm_s = time.perf_counter() - t0
    t_n = min(run(args.new_tokens)[0] for _ in range(args.repeats))
    t_1 = min(run(1)[0] for _ in range(args.repeats))
    tok_s = (args.new_tokens - 1) * len(prompts) / (t_n - t_1)
    kv_dev, kv_total = bytes_per_device(engine.kv)
    pages_dev, pages_total = bytes_per_device(engine.kv.layers)
    par_dev, par_total = bytes_per_device(engine.model.params)
    return dict(mesh=mesh_spec, tokens=tokens, tok_s=tok_s, kv_dev=kv_dev, kv_total=kv_total, pages_dev=pages_dev,
                pages_total=pages_total, par_dev=par_dev, par_total=par_total, warm_s=warm_s,
                decode_flops=step_flops(engine, False), prefill_flops=step_flops(engine, True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=128)
    parser.add_argument("--num-pages", type=int, default=136, help="KV pages, the same on every mesh (multiple of 8)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    model = make_model(args)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.config.vocab_size, (args.prompts, args.prompt_tokens)).tolist()

    results = []
    for spec in MESHES:
        r = run_mesh(model, spec, prompts, args)
        results.append(r)
        print(f"# {spec or 'one device'}: warmup + first runs {r['warm_s']:.1f} s", flush=True)
    base = results[0]

    print(f"\n{'mesh':<16} {'KV B/dev':>10} {'KV ratio':>8} {'pages ratio':>11} {'param B/dev':>11} "
          f"{'param ratio':>11} {'tokens eq':>9} {'tok/s':>8} {'tok/s ratio':>11} {'decode FLOP':>11} {'prefill FLOP':>12}")
    headline: dict = {}
    all_equal = True
    for r in results:
        kv_ratio = r["kv_dev"] / base["kv_total"]
        pages_ratio = r["pages_dev"] / base["pages_total"]
        par_ratio = r["par_dev"] / base["par_total"]
        equal = r["tokens"] == base["tokens"]
        all_equal &= equal
        tok_ratio = r["tok_s"] / base["tok_s"]
        decode_ratio = r["decode_flops"] / base["decode_flops"]
        prefill_ratio = r["prefill_flops"] / base["prefill_flops"]
        print(f"{r['mesh'] or 'one device':<16} {r['kv_dev']:>10} {kv_ratio:>8.4f} {pages_ratio:>11.4f} "
              f"{r['par_dev']:>11} {par_ratio:>11.4f} {str(equal):>9} {r['tok_s']:>8.1f} {tok_ratio:>11.3f} "
              f"{decode_ratio:>11.4f} {prefill_ratio:>12.4f}")
        name = SHORT[r["mesh"]]
        if r["mesh"] is not None:
            headline |= {f"kv_bytes_per_device_ratio_{name}": round(kv_ratio, 4),
                         f"param_bytes_per_device_ratio_{name}": round(par_ratio, 4),
                         f"tok_s_ratio_{name}": round(tok_ratio, 3), f"tokens_equal_{name}": equal,
                         f"decode_step_flops_per_device_ratio_{name}": round(decode_ratio, 4),
                         f"prefill_step_flops_per_device_ratio_{name}": round(prefill_ratio, 4)}
        headline[f"tok_s_{name}"] = round(r["tok_s"], 1)
    print(f"\n# {platform.machine()}, {os.cpu_count()} cpus, {jax.device_count()} simulated devices, jax {jax.__version__}; "
          f"{args.prompts} prompts x {args.prompt_tokens} ids, {args.new_tokens} new tokens, greedy, f32, "
          f"num_pages {args.num_pages}, page_size 16, max_slots 8, 8 prefill rows x 64")
    print("# m8: the 4 KV heads are stored twice (kv_head_copies) so each of the 8 model devices holds one;")
    print("# the simulated devices share the CPU cores: tok/s ratios measure partitioning overhead, not speedup.")
    headline["tokens_equal"] = all_equal
    headline["kv_bytes_one_device"] = base["kv_total"]
    headline["param_bytes_one_device"] = base["par_total"]
    headline["prefill_step_flops_one_device"] = base["prefill_flops"]
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
