"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random configs (CPU torch, f32):
QK norms, norms around attention and MLP with (1 + w) weights, GeGLU, sqrt(d_model) embedding
scale, RoPE base per layer type, query_pre_attn_scalar, soft-capped scores and logits,
interleaved local/global layers. Norm weights are randomised (HF initialises them to zero, which
would hide a swapped or missing norm)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.checkpoint import CheckpointError
from jaxinfer.loading import Model, load_model
from test_model_parity import all_position_logits
from test_variant_parity import assert_matches_transformers

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=112, max_position_embeddings=256, initializer_range=0.15,
            rms_norm_eps=1e-6, tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=24, sliding_window=8)
VARIANTS = {  # family, config changes, layer_windows the loader must read
    "gemma3": ("Gemma3", dict(num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention",
                                                                "full_attention", "sliding_attention"]),
               (8, 8, None, 8)),
    "gemma3-softcap-untied": ("Gemma3", dict(num_hidden_layers=3, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                                             tie_word_embeddings=False, sliding_window_pattern=3), (8, 8, None)),
    # Gemma 3 4B+: linear RoPE scaling on the global layers, none on the local ones
    "gemma3-linear-global": ("Gemma3", dict(num_hidden_layers=3, sliding_window_pattern=3, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}), (8, 8, None)),
    "gemma2": ("Gemma2", dict(num_hidden_layers=4, attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
               (8, None, 8, None)),
}


def save_tiny(path, family: str, **changes):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}TextConfig" if family == "Gemma3" else f"{family}Config")(**(BASE | changes))
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    model.set_attn_implementation("eager")  # torch's sdpa would drop the score soft-cap
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF starts (1 + w) norms at w = 0
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gemma_logits_and_greedy_match_transformers(tmp_path, variant):
    family, changes, windows = VARIANTS[variant]
    hf = save_tiny(tmp_path, family, **changes)
    ours = load_model(tmp_path)
    c = ours.config
    assert (c.arch, c.layer_windows, c.query_scale) == (family.lower(), windows, 24 ** -0.5)
    attn_cap = None if family == "Gemma3" else changes.get("attn_logit_softcapping")  # HF's Gemma 3 ignores it
    assert (c.attn_softcap, c.final_softcap) == (attn_cap, changes.get("final_logit_softcapping"))
    local = changes.get("rope_parameters", {}).get("sliding_attention", {}).get("rope_theta", 10000.0)
    assert c.rope_local_theta == (local if family == "Gemma3" else None)
    tokens = np.random.default_rng(1).integers(0, 211, (2, 40)).astype(np.int32)  # 40 tokens: 5 windows of 8
    assert_matches_transformers(hf, ours, tokens, 6, 24)  # decode: 30 tokens, past 3 windows


def test_gemma3_rope_bases_differ_per_layer_type(tmp_path):
    """Local layers rotate with 10k, global ones with rope_theta: giving both one base must break parity
    (so the parity test above would catch a model that ignores `rope_local_theta`)."""
    family, changes, _ = VARIANTS["gemma3"]
    hf = save_tiny(tmp_path, family, **changes)
    ours = load_model(tmp_path)
    tokens = np.random.default_rng(2).integers(0, 211, (1, 40)).astype(np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    one_base = dataclasses.replace(ours, config=ours.config.replace(rope_local_theta=None))
    assert np.abs(all_position_logits(one_base, tokens) - want).max() > 1e-2


@pytest.mark.parametrize("family", ["Gemma3", "Gemma2"])
def test_a_config_without_window_or_rope_base_reads_as_transformers_defaults(tmp_path, family):
    """A config.json without `sliding_window` (and, Gemma 3, without `rope_theta` /
    `rope_local_base_freq` or `rope_parameters`) loads as transformers reads it: windows of 4096
    on the local layers, global RoPE base 1e6 (it loaded all-global with one base of 10k)."""
    import transformers

    save_tiny(tmp_path, family, num_hidden_layers=3, sliding_window_pattern=3, **(
        {"rope_parameters": None} if family == "Gemma3" else {}))
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("sliding_window", "rope_theta", "rope_local_base_freq", "rope_parameters", "rope_scaling"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = load_model(tmp_path)
    assert ours.config.layer_windows[0] == hf.config.sliding_window == 4096
    tokens = np.random.default_rng(3).integers(0, 211, (1, 40)).astype(np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(all_position_logits(ours, tokens), want, atol=2e-4)


def test_gemma_bad_config_names_the_field(tmp_path):
    save_tiny(tmp_path, "Gemma3", num_hidden_layers=2)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_activation": "relu"}))
    with pytest.raises(CheckpointError, match="hidden_activation='relu'"):
        load_model(tmp_path)
    del config["query_pre_attn_scalar"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="query_pre_attn_scalar"):
        load_model(tmp_path)


def test_learned_sinks_and_soft_caps_reach_the_attention():
    """`attn_sinks` feeds `LayerParams.sinks` to the softmax: sinks at -1e9 change nothing, sinks at 0
    take weight from every key (so the output shrinks); `attn_softcap` and `final_softcap` bound
    what they cap. Checked against the plain model on a tiny random config."""
    from jaxinfer.model import init_random_params
    from tiny_models import random_tokens, tiny_config

    base = tiny_config()
    sinky = base.replace(attn_sinks=True)
    params = init_random_params(sinky, seed=0, scale=0.3)
    plain = dataclasses.replace(params, layers=tuple(dataclasses.replace(l, sinks=None) for l in params.layers))
    tokens = random_tokens((2, 12), base.vocab_size)
    want = all_position_logits(Model(base, plain, None), tokens)

    def logits(config, sinks):
        p = dataclasses.replace(params, layers=tuple(dataclasses.replace(l, sinks=jnp.full_like(l.sinks, sinks))
                                                     for l in params.layers))
        return all_position_logits(Model(config, p, None), tokens)

    np.testing.assert_allclose(logits(sinky, -1e9), want, atol=1e-5, rtol=0)
    assert np.abs(logits(sinky, 0.0) - want).max() > 1e-2
    np.testing.assert_allclose(logits(sinky.replace(final_softcap=0.5), -1e9), 0.5 * np.tanh(want / 0.5), atol=1e-5, rtol=0)
    assert np.abs(logits(sinky.replace(attn_softcap=0.1), -1e9) - want).max() > 1e-3


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, layout):
    """A `Gemma3ForConditionalGeneration` directory (Gemma 3 4B+: the text model under
    `language_model.model.` as released and as transformers 5 saves it, or under
    `model.language_model.` as transformers 4.5x did; a vision tower beside it) loads its
    language model: transformers' logits and greedy tokens for text, and no warning about the
    vision tensors."""
    import warnings

    import safetensors.numpy
    import transformers

    family, changes, windows = VARIANTS["gemma3-linear-global"]
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=BASE | changes, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=210, boi_token_index=208, eoi_token_index=209)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and "language_model" in name:
                p.copy_(0.5 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    if layout == "model.language_model.":
        stored = safetensors.numpy.load_file(tmp_path / "model.safetensors")
        safetensors.numpy.save_file({k.replace("language_model.model.", layout): v for k, v in stored.items()},
                                    tmp_path / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing about unused tensors
        ours = load_model(tmp_path)
    assert (ours.config.arch, ours.config.layer_windows) == ("gemma3", windows)
    tokens = np.random.default_rng(1).integers(0, 200, (2, 40)).astype(np.int32)  # below the image tokens
    assert_matches_transformers(hf, ours, tokens, 6, 24)


def test_gemma3_4b_config_reads_transformers_defaults(tmp_path):
    """The released Gemma 3 4B config lists only what differs from transformers' defaults in
    its `text_config`; the rest (heads, head_dim, RoPE bases, window pattern) are those defaults."""
    from jaxinfer.checkpoint.hf_loader import _text_model, config_from_hf
    from jaxinfer.config import LinearRopeScaling

    released = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
                "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                "sliding_window": 1024}}
    text, _ = _text_model(released, {}, tmp_path / "config.json")
    c = config_from_hf(text, tmp_path / "config.json", has_lm_head=False)
    assert (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (2560, 34, 8, 4, 256, 262208)
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 10000.0, LinearRopeScaling(8.0))
    assert c.layer_windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert (c.eos_ids, c.tie_embeddings, c.query_scale) == ((1, 106), True, 256 ** -0.5)
