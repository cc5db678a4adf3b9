"""gpt-oss against HF transformers on tiny random configs (CPU torch, f32): learned attention
sinks read from the checkpoint, biases on every attention projection, alternating sliding /
full layers, YaRN RoPE, and a mixture of experts (top-k router, clamped SwiGLU with biases).
Sinks and biases are randomised (HF initialises some to zero, which would hide a missing one)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from jaxinfer.checkpoint import CheckpointError, save_orbax
from jaxinfer.config import MoEConfig, YarnRopeScaling
from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.loading import load_model
from jaxinfer.sampling import SamplingParams
from test_model_parity import all_position_logits
from test_variant_parity import assert_matches_transformers

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=48, max_position_embeddings=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=6,
            num_experts_per_tok=2, initializer_range=0.2, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


def save_tiny(path, **changes):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**(BASE | changes))).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def test_gpt_oss_logits_and_greedy_match_transformers(tmp_path):
    hf = save_tiny(tmp_path)
    ours = load_model(tmp_path)
    c = ours.config
    assert (c.arch, c.layer_windows, c.attn_sinks, c.attn_bias, c.attn_out_bias) == ("gpt_oss", (8, None, 8, None), True, True, True)
    assert c.moe == MoEConfig(n_experts=6, experts_per_token=2, expert_dim=48)
    assert isinstance(c.rope_scaling, YarnRopeScaling) and c.rope_scaling.factor == 8.0
    np.testing.assert_array_equal(np.asarray(ours.params.layers[1].sinks), hf.model.layers[1].self_attn.sinks.detach().numpy())
    tokens = np.random.default_rng(1).integers(0, 211, (2, 40)).astype(np.int32)  # 40 tokens: 5 windows of 8
    ref = assert_matches_transformers(hf, ours, tokens, 6, 24)  # decode: 30 tokens, past 3 windows

    # the serving engine (paged, chunked prefill, windowed layers in their ring pool) gives the same tokens
    engine = Engine(ours, EngineConfig(max_slots=2, page_size=4, prefill_chunk=4, max_model_len=64))
    [out] = engine.generate([tokens[0, :6].tolist()], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert out.token_ids == ref


@pytest.mark.parametrize("broken", ["sinks", "yarn", "router"])
def test_gpt_oss_parity_needs_each_part(tmp_path, broken):
    """Dropping the sinks, YaRN's frequencies and attention factor, or the router's bias breaks
    parity: the test above would catch a model that ignores them."""
    hf = save_tiny(tmp_path)
    ours = load_model(tmp_path)
    if broken == "sinks":
        layers = [dataclasses.replace(layer, sinks=layer.sinks * 0 - 1e9) for layer in ours.params.layers]
        ours = dataclasses.replace(ours, params=dataclasses.replace(ours.params, layers=tuple(layers)))
    elif broken == "yarn":
        ours = dataclasses.replace(ours, config=ours.config.replace(rope_scaling=None))
    else:
        layers = [dataclasses.replace(layer, moe_router_bias=layer.moe_router_bias * 0) for layer in ours.params.layers]
        ours = dataclasses.replace(ours, params=dataclasses.replace(ours.params, layers=tuple(layers)))
    tokens = np.random.default_rng(1).integers(0, 211, (1, 40)).astype(np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(all_position_logits(ours, tokens) - want).max() > 1e-3


def test_gpt_oss_quantized_checkpoint_is_refused_by_name(tmp_path):
    save_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="mxfp4"):
        load_model(tmp_path)


def test_gpt_oss_orbax_round_trip(tmp_path):
    """`jaxinfer convert`'s orbax directory keeps the experts, YaRN and the sinks."""
    save_tiny(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    save_orbax(ours.config, ours.params, tmp_path / "orbax")
    again = load_model(tmp_path / "orbax")
    assert again.config == ours.config
    tokens = np.random.default_rng(2).integers(0, 211, (1, 12)).astype(np.int32)
    np.testing.assert_array_equal(all_position_logits(again, tokens), all_position_logits(ours, tokens))


def test_gpt_oss_default_config_matches_transformers(tmp_path):
    """transformers' own defaults (YaRN x32 over 4,096 positions, base 150k, 128-token windows)."""
    hf = save_tiny(tmp_path, rope_parameters=None, sliding_window=128, max_position_embeddings=131072)
    ours = load_model(tmp_path)
    assert ours.config.rope_theta == 150000.0 and ours.config.rope_scaling.factor == 32.0
    tokens = np.random.default_rng(3).integers(0, 211, (1, 24)).astype(np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(all_position_logits(ours, tokens), want, atol=1e-4, rtol=0)
