"""Attention variants over the paged state: masking options, sliding windows, the bounded
StreamingLLM cache, MLA absorption, KV bytes per token, and every variant in the engine."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import MLAConfig, ModelConfig, MoEConfig
from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.kv import NULL_PAGE, KVCacheSpec, LayerKV, block_table_array, init_paged_kv
from jaxinfer.kv.footprint import kv_bytes_per_token
from jaxinfer.kv.latent import LatentKV
from jaxinfer.kv.streaming import StreamingSpec, ring_logical_index
from jaxinfer.loading import Model
from jaxinfer.model import forward, init_random_params
from jaxinfer.attention.reference import paged_attention_reference
from jaxinfer.attention.reference import mla_attention_reference
from jaxinfer.sampling import SamplingParams
from tiny_models import random_tokens, tiny_config, tiny_model

# ---- the masking options of the reference -----------------------------------------------------


attend = jax.jit(paged_attention_reference, static_argnames=("scale", "window", "num_sinks", "soft_cap"))


def one_page(k, v) -> tuple[LayerKV, jax.Array]:
    """k, v: [S, Hkv, D] -> a cache whose page 1 holds them, and its block table."""
    pages = lambda x: jnp.zeros((2, *x.shape), jnp.float32).at[1].set(x)  # noqa: E731
    return LayerKV(k=pages(jnp.asarray(k, jnp.float32)), v=pages(jnp.asarray(v, jnp.float32))), jnp.array([[1]], jnp.int32)


def test_sink_logits_and_soft_cap_by_hand():
    # q = [ln 2, 0]; k0 = [0, 0], k1 = [1, 0] -> scores 0 and ln 2, i.e. weights 1 and 2.
    # A sink logit 0 adds exp(0) = 1 to the denominator: p = 1/4, 2/4 (1/4 goes nowhere),
    # so with v0 = [4, 0], v1 = [0, 4] the output is [1, 2]; without the sink [4/3, 8/3].
    q = jnp.array([[[[math.log(2.0), 0.0]]]])  # [B=1, T=1, H=1, D=2]
    kv, table = one_page([[[0.0, 0.0]], [[1.0, 0.0]]], [[[4.0, 0.0]], [[0.0, 4.0]]])
    args = (q, kv, table, jnp.array([2]), jnp.array([[1]]), 1.0)
    np.testing.assert_allclose(attend(*args)[0, 0, 0], [4 / 3, 8 / 3], rtol=1e-6)
    np.testing.assert_allclose(attend(*args, sink_logits=jnp.zeros(1))[0, 0, 0], [1, 2], rtol=1e-6)
    # Scores 0 and 100 capped at 2: 2 tanh(s / 2) -> 0 and ~2, weights 1 and e^2:
    # out = (v0 + e^2 v1) / (1 + e^2).
    q = jnp.array([[[[100.0, 0.0]]]])
    want = (np.array([4.0, 0.0]) + math.e**2 * np.array([0.0, 4.0])) / (1 + math.e**2)
    args = (q, kv, table, jnp.array([2]), jnp.array([[1]]), 1.0)
    np.testing.assert_allclose(attend(*args, soft_cap=2.0)[0, 0, 0], want, rtol=1e-6)
    np.testing.assert_allclose(attend(*args)[0, 0, 0], [0, 4], atol=1e-6)


def dense_attention(q, k, v, qi, n, window, sinks, sink_logits, cap):
    """One sequence, one query head per KV head group, plain numpy loops (f64)."""
    t, hq, d = q.shape
    out = np.zeros((t, hq, v.shape[-1]))
    for ti in range(t):
        keys = [j for j in range(n) if j <= qi[ti] and (window is None or j > qi[ti] - window or j < sinks)]
        for h in range(hq):
            kh = h // (hq // k.shape[1])
            s = np.array([q[ti, h] @ k[j, kh] for j in keys]) / math.sqrt(d)
            if cap is not None:
                s = cap * np.tanh(s / cap)
            e = np.exp(s - max(s.max(initial=-np.inf), -np.inf if sink_logits is None else sink_logits[h]))
            denom = e.sum() + (0 if sink_logits is None else np.exp(sink_logits[h] - max(s.max(initial=-np.inf), sink_logits[h])))
            out[ti, h] = sum(e_j * v[j, kh] for e_j, j in zip(e, keys)) / denom if keys else 0
    return out


@pytest.mark.parametrize("t", [6, 1])  # 1: a decode row, `decode_attention`'s layout
@pytest.mark.parametrize("window,sinks,use_sink_logits,cap", [(None, 0, False, None), (5, 0, False, None), (5, 2, True, 2.0), (1, 3, False, 30.0)])
def test_masking_options_match_a_dense_loop(window, sinks, use_sink_logits, cap, t):
    rng = np.random.default_rng(0)
    hq, hkv, d, page, n_pages = 6, 2, 8, 4, 5
    n = 17  # 17 cached tokens; the last t are this step's queries
    k, v = rng.standard_normal((2, n_pages * page, hkv, d))
    q = rng.standard_normal((1, t, hq, d))
    sink_logits = rng.standard_normal(hq) if use_sink_logits else None
    pages = np.array([3, 1, 4, 5, 2])  # logical block i lives in physical page pages[i]
    pool = lambda x: jnp.zeros((6, page, hkv, d), jnp.float32).at[pages].set(x.reshape(n_pages, page, hkv, d))  # noqa: E731
    qi = np.arange(n - t, n)
    got = attend(jnp.asarray(q, jnp.float32), LayerKV(pool(k), pool(v)), jnp.asarray(pages[None]),
                                    jnp.array([n]), jnp.asarray(qi[None]), 1 / math.sqrt(d), window=window, num_sinks=sinks,
                                    sink_logits=None if sink_logits is None else jnp.asarray(sink_logits, jnp.float32), soft_cap=cap)
    np.testing.assert_allclose(got[0], dense_attention(q[0], k, v, qi, n, window, sinks, sink_logits, cap), atol=2e-6, rtol=0)


def test_bad_masking_options_raise():
    q = jnp.zeros((1, 1, 2, 2))
    kv, table = one_page([[[0.0, 0.0]]], [[[0.0, 0.0]]])
    args = (q, kv, table, jnp.array([1]), jnp.array([[0]]), 1.0)
    for bad in (dict(window=0), dict(num_sinks=-1), dict(soft_cap=0.0), dict(sink_logits=jnp.zeros(3))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            paged_attention_reference(*args, **bad)


@pytest.mark.parametrize("t", [1, 3])  # the decode layout and the general one
def test_query_heads_that_do_not_fit_the_cache_raise(t):
    kv, table = one_page(np.zeros((4, 2, 2)), np.zeros((4, 2, 2)))  # 2 KV heads of dim 2
    index = jnp.zeros((1, t), jnp.int32)
    with pytest.raises(ValueError, match="query heads 3 must be a multiple of KV heads 2"):
        paged_attention_reference(jnp.zeros((1, t, 3, 2)), kv, table, jnp.array([4]), index, 1.0)
    with pytest.raises(ValueError, match="head_dim 4"):
        paged_attention_reference(jnp.zeros((1, t, 4, 4)), kv, table, jnp.array([4]), index, 1.0)


# ---- sliding windows over pages -----------------------------------------------------------------


def test_windowed_model_never_reads_a_page_behind_its_window():
    """Poison every page wholly behind the window (also as NULL_PAGE entries) with NaN: decode
    logits stay finite and bit-identical. Window 5, pages of 4: the query at 20 sees 16..20,
    so pages 0-3 (tokens 0..15) are dead and key 15 sits right behind the boundary."""
    config, params = tiny_model(layer_windows=(5, 5))
    spec = KVCacheSpec(num_pages=10, page_size=4, max_slots=1, max_pages_per_seq=8)
    tokens = random_tokens((1, 23), 97, seed=3)
    table = block_table_array([[9, 2, 7, 4, 1, 8, 3, 6]], 8)

    def run(poison):
        kv = init_paged_kv(config, spec).replace(block_tables=jnp.asarray(table))
        _, kv = forward(params, config, jnp.asarray(tokens[:, :20]), jnp.arange(20)[None], kv)
        kv = poison(kv)
        out = []
        for i in range(20, 23):
            logits, kv = forward(params, config, jnp.asarray(tokens[:, i : i + 1]), jnp.asarray([[i]]), kv)
            out.append(np.asarray(logits))
        return np.concatenate(out)

    nan_pages = lambda kv, pages: kv.replace(layers=jax.tree.map(lambda a: a.at[jnp.asarray(pages)].set(jnp.nan), kv.layers))  # noqa: E731
    clean = run(lambda kv: kv)
    poisoned = run(lambda kv: nan_pages(kv, [9, 2, 7, 4]))
    released = run(lambda kv: nan_pages(kv, [NULL_PAGE, 9, 2, 7, 4]).replace(block_tables=kv.block_tables.at[0, :4].set(NULL_PAGE)))
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(poisoned, clean)
    np.testing.assert_array_equal(released, clean)


# ---- the bounded StreamingLLM cache ---------------------------------------------------------------


def naive_streaming_logits(params, config: ModelConfig, tokens: list[int], sinks: int, window: int) -> np.ndarray:
    """StreamingLLM by hand, token by token in f64: per layer a list of un-rotated K/V of every
    token; token i attends to the sinks and its last `window` tokens, each rotated by its rank
    among the kept tokens (sinks 0..S-1, then the recent ones, the query last)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    c = config
    inv = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim)

    def rope(x, pos):  # x: [H, Dh]
        cos, sin = np.cos(pos * inv), np.sin(pos * inv)
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    rms = lambda x, w: x / np.sqrt(np.mean(x * x) + c.rms_eps) * w  # noqa: E731
    cache = [([], []) for _ in p.layers]
    logits = []
    for i, tok in enumerate(tokens):
        x = p.embed[tok]
        for layer, (ks, vs) in zip(p.layers, cache):
            h = rms(x, layer.attn_norm)
            q = (layer.wq @ h).reshape(c.n_heads, c.head_dim)
            ks.append((layer.wk @ h).reshape(c.n_kv_heads, c.head_dim))
            vs.append((layer.wv @ h).reshape(c.n_kv_heads, c.head_dim))
            keep = [j for j in range(i + 1) if j < sinks or j > i - window]
            k = np.stack([rope(ks[j], rank) for rank, j in enumerate(keep)])
            v = np.stack([vs[j] for j in keep])
            qr = rope(q, len(keep) - 1)
            out = []
            for head in range(c.n_heads):
                s = k[:, head // c.q_per_kv] @ qr[head] / math.sqrt(c.head_dim)
                w = np.exp(s - s.max())
                out.append(w @ v[:, head // c.q_per_kv] / w.sum())
            x = x + layer.wo @ np.concatenate(out)
            g = rms(x, layer.mlp_norm)
            a = layer.w_gate @ g
            x = x + layer.w_down @ (a / (1 + np.exp(-a)) * (layer.w_up @ g))
        logits.append(p.lm_head @ rms(x, p.final_norm))
    return np.stack(logits)


def test_streaming_cache_matches_streamingllm_by_hand_and_stays_bounded():
    """S=2 sinks + W=6 recent in 2 pages of 4: an 11-token prompt (longer than the ring) in one
    chunk, then 25 decode steps; every logit equals the by-hand StreamingLLM and the slot never
    holds more than S + W tokens."""
    config, params = tiny_model()
    stream = StreamingSpec(num_sinks=2, window=6)
    spec = KVCacheSpec(num_pages=3, page_size=4, max_slots=1, max_pages_per_seq=stream.pages_for(4))
    kv = init_paged_kv(config, spec, streaming=stream).replace(block_tables=jnp.array([[2, 1]], jnp.int32))
    tokens = random_tokens((36,), 97, seed=5).tolist()
    logits, kv = forward(params, config, jnp.asarray([tokens[:11]]), jnp.zeros((1, 11), jnp.int32), kv)
    got = [np.asarray(logits[0])]
    for i in range(11, 36):
        logits, kv = forward(params, config, jnp.asarray([[tokens[i]]]), jnp.zeros((1, 1), jnp.int32), kv)
        got.append(np.asarray(logits[0]))
        index, valid = ring_logical_index(stream, kv.lengths)
        held = np.asarray(index[0])[np.asarray(valid[0])]
        assert sorted(held) == [0, 1] + list(range(i - 5, i + 1))  # the sinks + the 6 most recent
    np.testing.assert_allclose(np.concatenate(got), naive_streaming_logits(params, config, tokens, 2, 6), atol=5e-5, rtol=0)


# ---- MLA -----------------------------------------------------------------------------------------


def test_mla_absorbed_equals_expanded_and_ignores_poison():
    """Decode by weight absorption (attend in latent space) equals expanding per-head K/V,
    on random latents with NaN in every slot past the sequence lengths."""
    rng = np.random.default_rng(0)
    b, t, h, dn, dr, dv, r, page = 2, 3, 4, 8, 4, 6, 16, 4
    table = jnp.array([[3, 1, 5, 0], [2, 4, 6, 0]], jnp.int32)
    lengths = jnp.array([11, 7])
    latent = LatentKV(c_kv=jnp.asarray(rng.standard_normal((7, page, r)), jnp.float32),
                      k_rope=jnp.asarray(rng.standard_normal((7, page, dr)), jnp.float32))
    slot = (jnp.arange(4 * page)[None, :] >= lengths[:, None])  # poison every token past the length
    poison = lambda pages: pages.at[table.reshape(-1)].set(  # noqa: E731
        jnp.where(slot.reshape(-1, page)[..., None], jnp.nan, pages[table.reshape(-1)]))
    latent = LatentKV(c_kv=poison(latent.c_kv), k_rope=poison(latent.k_rope))
    q_nope, q_rope = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for d in (dn, dr))
    w_uk, w_uv = (jnp.asarray(rng.standard_normal((h, d, r)) / 4, jnp.float32) for d in (dn, dv))
    query_index = lengths[:, None] - t + jnp.arange(t)
    args = (q_nope, q_rope, latent, w_uk, w_uv, table, lengths, query_index, (dn + dr) ** -0.5)
    mla = jax.jit(mla_attention_reference, static_argnames=("scale", "absorb"))
    absorbed = mla(*args[:-1], scale=args[-1], absorb=True)
    expanded = mla(*args[:-1], scale=args[-1], absorb=False)
    assert absorbed.shape == (b, t, h, dv) and np.isfinite(np.asarray(absorbed)).all()
    np.testing.assert_allclose(absorbed, expanded, atol=1e-5, rtol=0)


# ---- KV bytes per token, config --------------------------------------------------------------------


def test_kv_bytes_per_token_by_hand():
    llama = dict(arch="llama", vocab_size=10, d_model=576, n_layers=30, n_heads=9, head_dim=64, ffn_dim=8)
    # GQA (SmolLM2): 30 layers * 2 (K, V) * 3 heads * 64 * 4 bytes = 46080
    assert kv_bytes_per_token(ModelConfig(**llama, n_kv_heads=3)) == 46080
    assert kv_bytes_per_token(ModelConfig(**llama, n_kv_heads=9)) == 3 * 46080  # MHA
    assert kv_bytes_per_token(ModelConfig(**llama, n_kv_heads=1), dtype="bfloat16") == 46080 / 3 / 2  # MQA, bf16
    # Sinks 4 + 252 at 4096 tokens: each layer holds 256 of 4096 tokens -> 46080 / 16
    assert kv_bytes_per_token(ModelConfig(**llama, n_kv_heads=3), 4096, streaming=StreamingSpec(4, 252)) == 2880
    # Window 1024 on every other layer, 4096 tokens: (15 * 4096 + 15 * 1024) / (30 * 4096) of the full cost
    windowed = ModelConfig(**llama, n_kv_heads=3, layer_windows=(None, 1024) * 15)
    assert kv_bytes_per_token(windowed, 4096) == 46080 * (15 * 4096 + 15 * 1024) / (30 * 4096)
    assert kv_bytes_per_token(windowed, 1000) == 46080  # shorter than the window: nothing dropped yet
    # MLA, DeepSeek-V3 shape: 61 layers * (512 + 64) * 2 bytes (bf16)
    mla = ModelConfig(arch="deepseek_v3", vocab_size=10, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                      head_dim=192, ffn_dim=8, mla=MLAConfig(kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128))
    assert kv_bytes_per_token(mla, dtype="bfloat16") == 61 * 576 * 2
    with pytest.raises(ValueError, match="context_len"):
        kv_bytes_per_token(windowed)


def test_config_with_windows_mla_and_experts_round_trips_through_json():
    mla = MLAConfig(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=6, q_lora_rank=24)
    moe = MoEConfig(n_experts=4, experts_per_token=2, expert_dim=8, activation="swiglu", bias=False,
                    normalize_weights=False)
    configs = [tiny_config(layer_windows=(None, 4)),
               tiny_config(arch="deepseek_v3", n_heads=4, n_kv_heads=4, head_dim=12, mla=mla),
               tiny_config(arch="qwen3_moe", moe=moe)]
    for config in configs:
        again = ModelConfig.from_json(config.to_json())
        assert again == config and hash(again) == hash(config)
    with pytest.raises(ValueError, match="layer_windows"):
        tiny_config(layer_windows=(4,))
    with pytest.raises(ValueError, match="head_dim"):
        tiny_config(arch="deepseek_v3", n_heads=4, n_kv_heads=4, head_dim=8, mla=mla)
    with pytest.raises(ValueError, match="activation='gelu'"):
        MoEConfig(n_experts=4, experts_per_token=2, expert_dim=8, activation="gelu")


def test_qwen_sliding_windows_without_layer_types_follow_max_window_layers(tmp_path):
    """Qwen2/3 configs written before `layer_types`: with `use_sliding_window`, layers from
    `max_window_layers` on are windowed (transformers' reading); without it, none."""
    from jaxinfer.checkpoint.hf_loader import config_from_hf

    hf = dict(architectures=["Qwen3ForCausalLM"], vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
              intermediate_size=8, max_position_embeddings=64, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert config_from_hf(hf, tmp_path / "config.json").layer_windows == (None, None, 8, 8)
    assert config_from_hf(hf | {"architectures": ["Qwen2ForCausalLM"]}, tmp_path / "config.json").layer_windows == (None, None, 8, 8)
    assert config_from_hf(hf | {"use_sliding_window": False}, tmp_path / "config.json").layer_windows == ()


def test_hf_loader_rejects_mixture_of_experts_layers(tmp_path):
    from jaxinfer.checkpoint.errors import CheckpointError
    from jaxinfer.checkpoint.hf_loader import config_from_hf

    hf = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=10, hidden_size=8, num_hidden_layers=3,
              num_attention_heads=2, intermediate_size=8, max_position_embeddings=16, kv_lora_rank=4,
              qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2, q_lora_rank=None, n_routed_experts=4,
              first_k_dense_replace=1)
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        config_from_hf(hf, tmp_path / "config.json")
    assert config_from_hf(hf | dict(first_k_dense_replace=3), tmp_path / "config.json").mla.kv_lora_rank == 4


# ---- every variant in the engine ------------------------------------------------------------------


def greedy_alone(model: Model, prompt: list[int], n: int, streaming: StreamingSpec | None = None) -> list[int]:
    """One sequence straight through `forward`: the whole prompt at once (padded to 32), then
    one token per step."""
    page, width = 4, 32
    pages = streaming.pages_for(page) if streaming else -(-(width + n) // page)
    spec = KVCacheSpec(num_pages=pages + 1, page_size=page, max_slots=1, max_pages_per_seq=pages)
    kv = init_paged_kv(model.config, spec, streaming=streaming)
    kv = kv.replace(block_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None])
    padded = jnp.asarray([prompt + [0] * (width - len(prompt))])
    logits, kv = forward(model.params, model.config, padded, jnp.arange(width)[None], kv,
                         jnp.array([len(prompt)]), logits_index=jnp.array([len(prompt) - 1]))
    out = [int(logits[0].argmax())]
    for _ in range(n - 1):
        logits, kv = forward(model.params, model.config, jnp.asarray([[out[-1]]]), kv.lengths[:, None], kv)
        out.append(int(logits[0, 0].argmax()))
    return out


def mla_tiny_config() -> ModelConfig:
    mla = MLAConfig(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=6, q_lora_rank=24)
    return tiny_config(arch="deepseek_v3", n_heads=4, n_kv_heads=4, head_dim=12, mla=mla)


ENGINE_VARIANTS = {  # config, streaming, page size
    "window": (lambda: tiny_config(layer_windows=(6, 6)), None, 16),
    "interleaved": (lambda: tiny_config(layer_windows=(None, 6)), None, 16),
    "mla": (mla_tiny_config, None, 16),
    "streaming": (lambda: tiny_config(max_position=32), (2, 10), 4),  # a ring over 3 pages, past the context
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_variant_in_the_engine_equals_a_single_sequence_run(variant):
    """Three requests at once, chunked prefill (chunk 8). For the windowed and streaming
    variants the pool holds the three only because pages behind the window are released /
    rings stay bounded (at full length each would need 5 pages of 16 / 18 of 4): no
    preemption happens."""
    make_config, streaming, page_size = ENGINE_VARIANTS[variant]
    config = make_config()
    model = Model(config=config, params=init_random_params(config, seed=1, scale=0.3), tokenizer=None)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 97, n).tolist() for n in (5, 19, 30)]
    n_new = 40
    num_pages = {"window": 3 * 2 + 1, "streaming": 3 * 3 + 1}.get(variant)
    eng = Engine(model, EngineConfig(max_slots=3, page_size=page_size, prefill_chunk=8, num_pages=num_pages,
                                     streaming=streaming, max_model_len=None if streaming else 80))
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    outs, peak = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
        peak = max([peak] + [sum(p != NULL_PAGE for p in r.pages) for r in eng.scheduler.running])
    stream = StreamingSpec(*streaming) if streaming else None
    for i, p in enumerate(prompts):
        assert outs[f"req-{i}"] == greedy_alone(model, p, n_new, stream), f"request {i}"
    if variant == "window":  # keys n - 5 .. n + 7 of a step span at most 2 pages of 16
        assert peak <= 2 and eng.metrics().preemptions == 0
    if variant == "streaming":  # S + W = 12 tokens = 3 pages, however long the sequence
        assert peak == 3 and eng.metrics().preemptions == 0
