"""Attention variants against HF transformers (CPU torch, f32): sliding window (Mistral, every
layer), interleaved local/global layers (Qwen2 `layer_types`), QK norms with a head_dim of its
own and biases on all four projections (Qwen3), linear RoPE scaling (Llama), mixtures of experts (Mixtral; Qwen3-MoE with and
without renormalised top-k weights), DeepSeek-V3 MLA (dense MLP). Norm weights and biases are
randomised (HF initialises them to 1 and 0, which would hide a missing or misread one)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.checkpoint import CheckpointError
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.loading import load_model
from jaxinfer.model import forward
from test_model_parity import all_position_logits, hf_greedy

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=3, max_position_embeddings=256,
            initializer_range=0.15, rms_norm_eps=1e-5, tie_word_embeddings=False, num_attention_heads=4)
VARIANTS = {
    "mistral-window16": ("Mistral", dict(num_key_value_heads=2, sliding_window=16)),
    "qwen2-interleaved": ("Qwen2", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=8, num_hidden_layers=4,
                                        layer_types=["full_attention", "sliding_attention"] * 2)),
    "qwen3-qk-norm-bias": ("Qwen3", dict(num_key_value_heads=2, head_dim=24, attention_bias=True)),
    "qwen3-yarn-windows": ("Qwen3", dict(num_key_value_heads=2, num_hidden_layers=4, use_sliding_window=True,
                                         sliding_window=8, max_window_layers=2,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                          "original_max_position_embeddings": 32})),
    "llama-linear-rope": ("Llama", dict(num_key_value_heads=2, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                          "factor": 4.0})),
    "mixtral-moe": ("Mixtral", dict(num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2, sliding_window=16)),
    "qwen3-moe": ("Qwen3Moe", dict(num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                   moe_intermediate_size=40, norm_topk_prob=True)),
    "qwen3-moe-unnormalized": ("Qwen3Moe", dict(num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=3,
                                                moe_intermediate_size=40, norm_topk_prob=False)),
    "deepseek-v3-mla": ("DeepseekV3", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                           qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=3, n_routed_experts=4,
                                           num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16)),
    "deepseek-v3-mla-no-q-lora": ("DeepseekV3", dict(num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=None,
                                                     qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10,
                                                     first_k_dense_replace=3, n_routed_experts=4, num_experts_per_tok=2,
                                                     n_group=1, topk_group=1, moe_intermediate_size=16)),
}
EXPECTED = {  # layer_windows the loader must read
    "mistral-window16": (16, 16, 16),
    "qwen2-interleaved": (None, 8, None, 8),
    "qwen3-qk-norm-bias": (),
    "qwen3-yarn-windows": (None, None, 8, 8),
    "llama-linear-rope": (),
    "mixtral-moe": (16, 16, 16),
    "qwen3-moe": (),
    "qwen3-moe-unnormalized": (),
    "deepseek-v3-mla": (),
    "deepseek-v3-mla-no-q-lora": (),
}


def save_tiny(path, family: str, **changes):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**(BASE | changes))
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # norm weights start at 1 and biases at 0: make them count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def greedy_one_by_one(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Prefill the prompt in one group, then decode `n` greedy tokens one per step (the decode
    path: absorbed MLA, single-query window masks) -> (tokens, f32[n, V] logits behind them)."""
    spec = KVCacheSpec.for_batch(1, len(prompt) + n, page_size=8)
    kv = init_paged_kv(model.config, spec)
    kv = kv.replace(block_tables=jnp.asarray(np.arange(spec.num_pages - 1, 0, -1, dtype=np.int32)[None]))
    logits, kv = forward(model.params, model.config, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], kv)
    out, last = [], np.asarray(logits[0, -1])
    for i in range(len(prompt), len(prompt) + n):
        out.append(last)
        token = int(last.argmax())
        logits, kv = forward(model.params, model.config, jnp.asarray([[token]]), jnp.asarray([[i]]), kv)
        last = np.asarray(logits[0, 0])
    return [int(x.argmax()) for x in out], np.stack(out)


def assert_matches_transformers(hf, ours, tokens: np.ndarray, prompt_len: int, new_tokens: int) -> list[int]:
    """Logits at every position of `tokens` (the prefill path) and along `new_tokens` greedy
    steps after the first `prompt_len` tokens of row 0 (the decode path) within 1e-4 of
    transformers', greedy tokens equal -> transformers' greedy tokens."""
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(all_position_logits(ours, tokens), want, atol=1e-4, rtol=0)  # prefill path

    prompt = tokens[0, :prompt_len].tolist()
    ref = hf_greedy(hf, prompt, new_tokens)
    got, logits = greedy_one_by_one(ours, prompt, new_tokens)
    assert got == ref
    with torch.no_grad():
        want = hf(torch.tensor([prompt + ref[:-1]])).logits[0, len(prompt) - 1 :].numpy()
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)  # decode path
    return ref


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_logits_and_greedy_match_transformers(tmp_path, variant):
    family, changes = VARIANTS[variant]
    hf = save_tiny(tmp_path, family, **changes)
    ours = load_model(tmp_path)
    assert ours.config.layer_windows == EXPECTED[variant]
    assert (ours.config.mla is not None) == family.startswith("Deepseek")
    tokens = np.random.default_rng(1).integers(0, 211, (2, 72)).astype(np.int32)  # 72 tokens: 4.5 windows of 16
    assert_matches_transformers(hf, ours, tokens, 12, 32)  # decode: 44 tokens, past 2 windows


def test_qwen3_moe_with_dense_layers_is_refused(tmp_path):
    """Qwen3-MoE's dense layers among the experts (`mlp_only_layers`) are not supported: an
    error naming the field, not a model that silently reads experts that are not there."""
    family, changes = VARIANTS["qwen3-moe"]
    save_tiny(tmp_path, family, **changes, mlp_only_layers=[1])
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        load_model(tmp_path)
