"""StreamingLLM on SmolLM2-135M: attention sinks vs window-only eviction vs recomputation vs full cache.

Scores `--tokens` tokens of real English text available offline (the CPython documentation
topics in the standard library's `pydoc_data.topics`), f32, with four caches:

    full          every token attends to everything before it
    sinks         StreamingLLM: 4 sink tokens + the 252 most recent (positions inside the cache)
    window_only   the 256 most recent tokens, no sinks (positions inside the cache)
    recompute     each scored token predicted from its 256 predecessors re-encoded as a fresh
                  context (StreamingLLM's sliding-window-with-recomputation baseline)

Full, sinks and window-only run over the whole text in chunks (each query sees exactly its
S + W keys, as if decoded one token at a time) and give a negative log-likelihood for every
token; recompute is scored on every `--stride`-th token from position 256 on, and the
perplexities of all four are compared on those same positions. Also prints KV bytes per
token for SmolLM2 and for a DeepSeek-V2-shaped MLA config. Last line: one JSON object.

    python benchmarks/attention_variants.py [--tokens 4096] [--stride 16] [--out curves.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import MLAConfig, ModelConfig
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.kv.footprint import kv_bytes_per_token
from jaxinfer.kv.streaming import StreamingSpec
from jaxinfer.loading import load_model
from jaxinfer.model import forward

SINKS, WINDOW = 4, 256  # the sink cache keeps 4 + 252, window-only 256, recompute 256 predecessors
PAGE = 16


def pydoc_tokens(tokenizer, n: int) -> list[int]:
    """The first `n` tokens of the CPython documentation topics (sorted by topic name)."""
    from pydoc_data.topics import topics

    ids = []
    for name in sorted(topics):
        ids += tokenizer.encode(topics[name] + "\n\n", add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"pydoc_data.topics has only {len(ids)} tokens, fewer than {n}")


@jax.jit
def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits f32[..., V], targets i32[...] -> -log p(target)."""
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


def chunked_nll(model, tokens: np.ndarray, streaming: StreamingSpec | None, chunk: int) -> np.ndarray:
    """NLL of tokens[1:] given everything before (as the cache allows), in chunks of `chunk`."""
    n = len(tokens)
    pages = streaming.pages_for(PAGE) if streaming else -(-n // PAGE)
    spec = KVCacheSpec(num_pages=pages + 1, page_size=PAGE, max_slots=1, max_pages_per_seq=pages)
    kv = init_paged_kv(model.config, spec, streaming=streaming)
    kv = kv.replace(block_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None])
    out = []
    for start in range(0, n - 1, chunk):
        piece = tokens[start : start + chunk]
        num = len(piece)
        padded = np.zeros((1, chunk), np.int32)
        padded[0, :num] = piece
        positions = jnp.arange(start, start + chunk, dtype=jnp.int32)[None]
        logits, kv = forward(model.params, model.config, jnp.asarray(padded), positions, kv, jnp.array([num]))
        targets = np.zeros((1, chunk), np.int32)
        nxt = tokens[start + 1 : start + chunk + 1]
        targets[0, : len(nxt)] = nxt
        out.append(np.asarray(token_nll(logits, jnp.asarray(targets)))[0, : len(nxt)])
    return np.concatenate(out)  # [n - 1]: entry i is -log p(token i + 1)


def recompute_nll(model, tokens: np.ndarray, scored: np.ndarray, batch: int) -> np.ndarray:
    """For each scored position p: -log p(token p | tokens[p - WINDOW : p]) as a fresh context."""
    spec = KVCacheSpec.for_batch(batch, WINDOW, PAGE)
    kv = init_paged_kv(model.config, spec)
    kv = kv.replace(block_tables=jnp.arange(1, spec.num_pages, dtype=jnp.int32).reshape(batch, -1))
    positions = jnp.broadcast_to(jnp.arange(WINDOW, dtype=jnp.int32), (batch, WINDOW))
    out = []
    for start in range(0, len(scored), batch):
        ps = scored[start : start + batch]
        rows = np.stack([tokens[p - WINDOW : p] for p in ps] + [tokens[:WINDOW]] * (batch - len(ps)))
        kv = kv.replace(lengths=jnp.zeros_like(kv.lengths))
        logits, kv = forward(model.params, model.config, jnp.asarray(rows), positions, kv,
                             logits_index=jnp.full((batch,), WINDOW - 1, jnp.int32))
        targets = np.array([tokens[p] for p in ps] + [0] * (batch - len(ps)), np.int32)
        out.append(np.asarray(token_nll(logits, jnp.asarray(targets)))[: len(ps)])
    return np.concatenate(out)


def deepseek_v2_shapes() -> tuple[ModelConfig, ModelConfig]:
    """DeepSeek-V2 (60 layers, 128 heads, kv_lora_rank 512, rope dim 64) and the MHA baseline
    of its paper (128 heads of 128 per layer, K and V cached)."""
    common = dict(vocab_size=102400, d_model=5120, n_layers=60, n_heads=128, n_kv_heads=128, ffn_dim=12288, dtype="bfloat16")
    mla = ModelConfig(arch="deepseek_v3", head_dim=192, **common,
                      mla=MLAConfig(kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, q_lora_rank=1536))
    mha = ModelConfig(arch="llama", head_dim=128, **common)
    return mla, mha


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--stride", type=int, default=16, help="recompute scores every stride-th token")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="recompute windows per forward")
    parser.add_argument("--out", help="write the per-token NLL curves here (JSON)")
    args = parser.parse_args()

    model = load_model(progress=False)
    tokens = np.asarray(pydoc_tokens(model.tokenizer, args.tokens), np.int32)
    print(f"SmolLM2-135M f32, {len(tokens)} tokens of pydoc_data.topics, jax {jax.__version__} {jax.devices()[0].platform}")
    curves, seconds = {}, {}
    for name, streaming in [("full", None), ("sinks", StreamingSpec(SINKS, WINDOW - SINKS)),
                            ("window_only", StreamingSpec(0, WINDOW))]:
        t0 = time.perf_counter()
        curves[name] = chunked_nll(model, tokens, streaming, args.chunk)
        seconds[name] = time.perf_counter() - t0
        print(f"{name:12s} {seconds[name]:7.1f} s  ppl over all {len(curves[name])} tokens: {math.exp(curves[name].mean()):8.3f}")
    scored = np.arange(WINDOW, len(tokens), args.stride)  # positions whose context exceeds the window
    t0 = time.perf_counter()
    recompute = recompute_nll(model, tokens, scored, args.batch)
    seconds["recompute"] = time.perf_counter() - t0
    ppl = {name: math.exp(curve[scored - 1].mean()) for name, curve in curves.items()}
    ppl["recompute"] = math.exp(recompute.mean())
    print(f"recompute    {seconds['recompute']:7.1f} s")
    print(f"perplexity on the {len(scored)} positions {scored[0]}, {scored[0] + args.stride}, ... (context > {WINDOW}):")
    for name in ("full", "recompute", "sinks", "window_only"):
        print(f"  {name:12s} {ppl[name]:9.3f}   x{ppl[name] / ppl['recompute']:.3f} of recompute")

    smol = model.config
    mla, mha = deepseek_v2_shapes()
    print("KV bytes per token:")
    print(f"  SmolLM2 GQA 3 kv heads, f32: {kv_bytes_per_token(smol):.0f}; "
          f"sinks {SINKS}+{WINDOW - SINKS} at {len(tokens)} tokens: "
          f"{kv_bytes_per_token(smol, len(tokens), streaming=StreamingSpec(SINKS, WINDOW - SINKS)):.0f}")
    print(f"  DeepSeek-V2 shape, bf16: MLA {kv_bytes_per_token(mla):.0f} vs MHA {kv_bytes_per_token(mha):.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": tokens.tolist(), "scored": scored.tolist(), "recompute": recompute.tolist(),
                       **{k: v.tolist() for k, v in curves.items()}}, f)
    print(json.dumps({
        "full_ppl": round(ppl["full"], 4), "recompute_ppl": round(ppl["recompute"], 4),
        "sinks_ppl": round(ppl["sinks"], 4), "window_only_ppl": round(ppl["window_only"], 4),
        "sinks_over_recompute": round(ppl["sinks"] / ppl["recompute"], 4),
        "window_only_over_recompute": round(ppl["window_only"] / ppl["recompute"], 4),
        "mla_bytes_over_mha": round(kv_bytes_per_token(mla) / kv_bytes_per_token(mha), 5),
    }))


if __name__ == "__main__":
    main()
