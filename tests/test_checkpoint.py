"""Checkpoint loaders (HF safetensors, GGUF) and the orbax format.

Every loaded tensor is compared exactly (f32) with its source: the torch state dict for HF
directories, the HF-layout arrays we wrote for GGUF files. The name maps and llama.cpp's q/k
permutation are written out here independently of the loaders under test.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxinfer.checkpoint import CheckpointError, load_checkpoint, load_gguf, load_hf_dir, load_orbax, save_orbax
from jaxinfer.checkpoint.orbax_io import save_tokenizer
from jaxinfer.config import LinearRopeScaling, Llama3RopeScaling, ModelConfig, MoEConfig
from jaxinfer.model.params import ModelParams, init_random_params
from jaxinfer.tokenizer import Tokenizer

# --- shared helpers --------------------------------------------------------------------------

HF_GLOBAL = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",  # Qwen3
}
GGUF_GLOBAL = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
GGUF_LAYER = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",  # Qwen3
    "moe_router": "ffn_gate_inp.weight",  # Mixtral, Qwen3-MoE
}


def source_name(name: str, global_map: dict[str, str], layer_map: dict[str, str], layer_fmt: str) -> str:
    if name in global_map:
        return global_map[name]
    _, layer, field = name.split(".")
    return layer_fmt.format(layer) + layer_map[field]


def hf_name(name: str) -> str:
    return source_name(name, HF_GLOBAL, HF_LAYER, "model.layers.{}.")


def gguf_name(name: str) -> str:
    return source_name(name, GGUF_GLOBAL, GGUF_LAYER, "blk.{}.")


def flat(params: ModelParams) -> dict[str, np.ndarray]:
    """Our parameter names -> arrays (None fields left out)."""
    out = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    for i, layer in enumerate(params.layers):
        out |= {f"layers.{i}.{f.name}": getattr(layer, f.name) for f in dataclasses.fields(layer)}
    return {k: np.asarray(v) for k, v in out.items() if v is not None}


def assert_trees_equal(a: ModelParams, b: ModelParams) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    fa, fb = flat(a), flat(b)
    for name in fa:
        assert fa[name].dtype == fb[name].dtype, name
        np.testing.assert_array_equal(fa[name], fb[name], err_msg=name)


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim (numpy for torch)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def converter_rope_factors(theta, dim, factor, low_freq_factor, high_freq_factor, old_context_len):
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.generate_extra_tensors` (Llama 3 `rope_freqs`)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def error_message(excinfo) -> str:
    return str(excinfo.value)


# --- Hugging Face directories ----------------------------------------------------------------

HF_COMMON = dict(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 max_position_embeddings=128, rms_norm_eps=1e-5)
HF_VARIANTS = {
    "llama-mha-untied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-gqa-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral-mqa": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=16)),
    "qwen2-gqa-tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-gqa-tied": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           tie_word_embeddings=True)),
}


def save_hf_model(directory: Path, config_class: str, *, torch_dtype=None, max_shard_size=None,
                  **fields) -> dict[str, np.ndarray]:
    """Save a tiny random transformers model; returns its state dict as f32 numpy."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**(HF_COMMON | fields))
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # default init has unit norms and zero biases: make every tensor distinct
        for p in model.parameters():
            p.normal_()
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def assert_matches_state_dict(config: ModelConfig, params: ModelParams, state: dict[str, np.ndarray]) -> None:
    ours = flat(params)
    expected_names = set(state) - ({"lm_head.weight"} if config.tie_embeddings else set())
    assert {hf_name(n) for n in ours} == expected_names
    for name, array in ours.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, state[hf_name(name)], err_msg=name)
    if config.tie_embeddings:
        np.testing.assert_array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """One saved tiny GQA Llama, untied; tests that corrupt it work on a copy."""
    directory = tmp_path_factory.mktemp("llama")
    state = save_hf_model(directory, "LlamaConfig", num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=False)
    return directory, state


def copy_of(llama_dir, tmp_path) -> Path:
    return Path(shutil.copytree(llama_dir[0], tmp_path / "copy"))


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_hf_dir_matches_torch_state_dict(tmp_path, variant):
    config_class, fields = HF_VARIANTS[variant]
    state = save_hf_model(tmp_path, config_class, **fields)
    config, params = load_hf_dir(tmp_path)
    assert_matches_state_dict(config, params, state)
    assert config.arch == variant.split("-")[0]
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (4, fields["num_key_value_heads"], 8)
    assert config.tie_embeddings == fields.get("tie_word_embeddings", False)
    assert config.attn_bias == (config.arch == "qwen2")
    assert (params.lm_head is None) == config.tie_embeddings


def test_hf_llama_config_fields(llama_dir):
    config, _ = load_hf_dir(llama_dir[0])
    assert config == ModelConfig(
        arch="llama", vocab_size=67, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
        rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5, max_position=128, tie_embeddings=False,
        attn_bias=False, dtype="float32", bos_id=1, eos_ids=(2,),
    )


def test_hf_eos_list_and_generation_config_eos(llama_dir, tmp_path):
    directory = copy_of(llama_dir, tmp_path)
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(hf | {"eos_token_id": [2, 5]}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    config, _ = load_hf_dir(directory)
    assert config.eos_ids == (2, 5, 7)


def test_generation_config_sampling_defaults_are_read_and_travel(llama_dir, tmp_path):
    """The sampling fields of generation_config.json (vLLM reads them as request defaults) come
    with the model (`Model.generation_config`, `Engine.default_sampling_params`) and are written
    back where a conversion writes the tokenizer's generation config."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.loading import load_model, sampling_defaults, write_sampling_defaults

    directory = copy_of(llama_dir, tmp_path)
    gen = json.loads((directory / "generation_config.json").read_text())
    recommended = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 100, "do_sample": True}
    (directory / "generation_config.json").write_text(json.dumps(gen | recommended))
    model = load_model(directory, progress=False)
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    assert model.generation_config == want
    params = Engine(model, EngineConfig(max_slots=1, max_model_len=64)).default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.min_p) == (0.6, 0.95, 20, 100, 0.0)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    write_sampling_defaults(other, model.generation_config)
    assert sampling_defaults(other) == want and json.loads((other / "generation_config.json").read_text())["eos_token_id"] == [2]


def test_hf_sharded_checkpoint(tmp_path):
    state = save_hf_model(tmp_path, "LlamaConfig", num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=False, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    config, params = load_hf_dir(tmp_path)
    assert_matches_state_dict(config, params, state)


def test_hf_missing_shard_file(tmp_path):
    save_hf_model(tmp_path, "LlamaConfig", num_attention_heads=4, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError) as excinfo:
        load_hf_dir(tmp_path)
    assert shard.name in error_message(excinfo) and "no such safetensors file" in error_message(excinfo)


def test_hf_bfloat16_checkpoint(tmp_path):
    import torch

    state = save_hf_model(tmp_path, "LlamaConfig", num_attention_heads=4, num_key_value_heads=2,
                          torch_dtype=torch.bfloat16)
    with safetensors.safe_open(tmp_path / "model.safetensors", framework="flax") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    config, params = load_hf_dir(tmp_path)  # f32: bf16 values are exact in f32
    assert_matches_state_dict(config, params, state)
    config16, params16 = load_hf_dir(tmp_path, dtype="bfloat16")
    assert config16 == config.replace(dtype="bfloat16")
    assert params16.embed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params16.embed, np.float32), state["model.embed_tokens.weight"])


LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def test_hf_llama3_rope_scaling_new_and_legacy_config(tmp_path):
    save_hf_model(tmp_path, "LlamaConfig", num_attention_heads=4, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", **LLAMA3_ROPE})
    hf = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in hf  # transformers >= 5 format: rope_theta inside rope_parameters
    want = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64)
    config, _ = load_hf_dir(tmp_path)
    assert (config.rope_theta, config.rope_scaling) == (500000.0, want)

    # transformers 4.x format: `rope_scaling` with `type`, `rope_theta` at the top level.
    del hf["rope_parameters"]
    legacy = hf | {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_ROPE}}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    config, _ = load_hf_dir(tmp_path)
    assert (config.rope_theta, config.rope_scaling) == (500000.0, want)


def test_hf_rope_theta_default_and_head_dim_derived(llama_dir, tmp_path):
    directory = copy_of(llama_dir, tmp_path)
    hf = json.loads((directory / "config.json").read_text())
    hf = {k: v for k, v in hf.items() if k not in ("head_dim", "rope_parameters")} | {"rope_theta": 1234.0}
    (directory / "config.json").write_text(json.dumps(hf))
    config, _ = load_hf_dir(directory)
    assert (config.head_dim, config.rope_theta, config.rope_scaling) == (8, 1234.0, None)


def test_hf_null_optional_fields_read_as_absent(llama_dir, tmp_path):
    """An optional field written as null means its default, as transformers reads it (a tied
    embedding decided by whether `lm_head.weight` is stored), not a TypeError."""
    directory = copy_of(llama_dir, tmp_path)
    hf = json.loads((directory / "config.json").read_text())
    nulls = {"rope_theta": None, "rms_norm_eps": None, "tie_word_embeddings": None, "hidden_act": None}
    (directory / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k != "rope_parameters"} | nulls))
    config, params = load_hf_dir(directory)
    assert (config.rope_theta, config.rms_eps, config.tie_embeddings) == (10000.0, 1e-6, False)
    assert params.lm_head is not None


def rewrite_config(directory: Path, **changes) -> None:
    hf = json.loads((directory / "config.json").read_text())
    hf = {k: v for k, v in (hf | changes).items() if v is not None}
    (directory / "config.json").write_text(json.dumps(hf))


def rewrite_safetensors(directory: Path, edit) -> None:
    file = directory / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    edit(tensors)
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def drop_up_proj(tensors):
    del tensors["model.layers.1.mlp.up_proj.weight"]


def shrink_k_proj(tensors):
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)


HF_CORRUPTIONS = {
    "missing tensor": (lambda d: rewrite_safetensors(d, drop_up_proj),
                       ["missing tensor", "'model.layers.1.mlp.up_proj.weight'"]),
    "wrong shape": (lambda d: rewrite_safetensors(d, shrink_k_proj),
                    ["model.safetensors", "'model.layers.0.self_attn.k_proj.weight'", "(8, 32)", "expected (16, 32)"]),
    "truncated file": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]),
                       ["model.safetensors", "truncated or corrupt"]),
    "missing config field": (lambda d: rewrite_config(d, hidden_size=None),
                             ["config.json", "missing config field 'hidden_size'"]),
    "unsupported rope": (lambda d: rewrite_config(d, rope_parameters={"rope_type": "dynamic", "factor": 4.0}),
                         ["config.json", "rope_type='dynamic'"]),
    "yarn without its context": (lambda d: rewrite_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                                 ["config.json", "missing config field 'original_max_position_embeddings'"]),
    "unsupported activation": (lambda d: rewrite_config(d, hidden_act="gelu"),
                               ["config.json", "hidden_act='gelu'"]),
    "attention bias on llama": (lambda d: rewrite_config(d, attention_bias=True),
                                ["config.json", "attention_bias"]),
}


@pytest.mark.parametrize("case", list(HF_CORRUPTIONS))
def test_hf_broken_checkpoint_raises_checkpoint_error(llama_dir, tmp_path, case):
    corrupt, expected = HF_CORRUPTIONS[case]
    directory = copy_of(llama_dir, tmp_path)
    corrupt(directory)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(directory)
    for fragment in expected:
        assert fragment in error_message(excinfo)
    assert str(directory) in error_message(excinfo)


def test_hf_config_with_fewer_layers_than_the_weights_warns(llama_dir, tmp_path):
    directory = copy_of(llama_dir, tmp_path)
    stored = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    rewrite_config(directory, num_hidden_layers=stored - 1)
    with pytest.warns(UserWarning, match=f"not used by its config.*the weights hold {stored} layers but config.json "
                                         f"has num_hidden_layers={stored - 1}, so only the first {stored - 1} run"):
        config, _ = load_hf_dir(directory)
    assert config.n_layers == stored - 1


def test_hf_unsupported_architecture(tmp_path):
    import transformers

    config = transformers.GPT2Config(vocab_size=67, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(tmp_path)
    assert "unsupported architecture" in error_message(excinfo) and "GPT2LMHeadModel" in error_message(excinfo)


# --- GGUF files --------------------------------------------------------------------------------

# A tiny byte-level BPE vocabulary (GPT-2 alphabet: "Ġ" is the space byte).
TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(chr(c) for c in range(33, 127)),
               "Ġ", "he", "ll", "Ġt", "hell", "hello"]
TINY_MERGES = ["h e", "l l", "Ġ t", "he ll", "hell o"]
TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def tiny_config(arch: str = "llama", **changes) -> ModelConfig:
    fields = dict(arch=arch, vocab_size=len(TINY_TOKENS), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=8, ffn_dim=48, rope_theta=10000.0, rms_eps=1e-5, max_position=128,
                  attn_bias=arch == "qwen2", bos_id=0, eos_ids=(2,))
    return ModelConfig(**(fields | changes))


def write_gguf(path: Path, config: ModelConfig, weights: dict[str, np.ndarray], *, arch: str | None = None,
               skip: tuple[str, ...] = (), rope_freqs: np.ndarray | None = None,
               qtype: gguf.GGMLQuantizationType | None = None, linear_rope: float | None = None,
               tokenizer: bool = True) -> Path:
    """Write `weights` (our names, HF layout) the way llama.cpp's converter would: llama q/k
    rows permuted, ggml names, experts stacked [E, out, in] per matrix, f32 (matrices in
    `qtype` if given). `skip` leaves out metadata fields or tensors by name."""
    arch = arch or config.arch
    writer = gguf.GGUFWriter(str(path), arch)
    ints = {"block_count": config.n_layers, "context_length": config.max_position,
            "embedding_length": config.d_model, "feed_forward_length": config.ffn_dim,
            "attention.head_count": config.n_heads, "attention.head_count_kv": config.n_kv_heads,
            "rope.dimension_count": config.head_dim}
    if config.moe is not None:
        ints |= {"expert_count": config.moe.n_experts, "expert_used_count": config.moe.experts_per_token,
                 "expert_feed_forward_length": config.moe.expert_dim}
    for key, value in ints.items():
        if key not in skip:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_eps)
    if linear_rope is not None:  # llama.cpp's keys for linear RoPE scaling
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", linear_rope)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list(TINY_TOKENS)
        writer.add_token_types([3, 3, 3] + [1] * (len(TINY_TOKENS) - 3))
        writer.add_token_merges(TINY_MERGES)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_chat_template(TINY_TEMPLATE)
    weights = dict(weights)
    for name in [n for n in weights if n.endswith(("moe_gate_up", "moe_down"))]:  # ours [E, in, out] -> [E, out, in]
        block, array = f"blk.{name.split('.')[1]}.", weights.pop(name).transpose(0, 2, 1)
        if name.endswith("moe_down"):
            writer.add_tensor(block + "ffn_down_exps.weight", np.ascontiguousarray(array, dtype=np.float32))
        else:  # gate and up rows alternate in ours
            writer.add_tensor(block + "ffn_gate_exps.weight", np.ascontiguousarray(array[:, ::2], dtype=np.float32))
            writer.add_tensor(block + "ffn_up_exps.weight", np.ascontiguousarray(array[:, 1::2], dtype=np.float32))
    for name, array in weights.items():
        field = name.rsplit(".", 1)[-1]
        if arch == "llama" and field in ("wq", "bq"):
            array = llama_permute(array, config.n_heads, config.n_heads)
        if arch == "llama" and field in ("wk", "bk"):
            array = llama_permute(array, config.n_heads, config.n_kv_heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if gguf_name(name) in skip:
            continue
        if qtype is not None and array.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), array)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("gguf_arch, arch", [("llama", "mixtral"), ("qwen3moe", "qwen3_moe")])
def test_gguf_experts_recover_hf_layout(tmp_path, gguf_arch, arch):
    """Mixtral (a llama file with experts) and Qwen3-MoE: the router and the stacked [E, out, in]
    expert matrices come back in our layout; the chosen experts' weights are renormalised, as
    llama.cpp does for both."""
    moe = MoEConfig(n_experts=4, experts_per_token=2, expert_dim=24, activation="swiglu", bias=False)
    config = tiny_config(arch, moe=moe, ffn_dim=24 if arch == "mixtral" else 48)
    weights = flat(init_random_params(config, seed=1, scale=1.0))
    assert {"layers.0.moe_router", "layers.0.moe_gate_up", "layers.0.moe_down"} <= weights.keys()
    skip = ("expert_feed_forward_length",) if arch == "mixtral" else ()  # Mixtral's files: feed_forward_length
    loaded_config, params = load_gguf(write_gguf(tmp_path / "tiny.gguf", config, weights, arch=gguf_arch, skip=skip))
    assert loaded_config == config
    loaded = flat(params)
    assert loaded.keys() == weights.keys()
    for name in weights:
        np.testing.assert_array_equal(loaded[name], weights[name], err_msg=name)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_gguf_recovers_hf_layout(tmp_path, arch, tied):
    config = tiny_config(arch, tie_embeddings=tied)
    weights = flat(init_random_params(config, seed=1, scale=1.0))
    path = write_gguf(tmp_path / "tiny.gguf", config, weights)
    loaded_config, params = load_gguf(path)
    assert loaded_config == config
    loaded = flat(params)
    assert loaded.keys() == weights.keys()
    for name in weights:
        np.testing.assert_array_equal(loaded[name], weights[name], err_msg=name)


def test_gguf_llama3_rope_freqs(tmp_path):
    config = tiny_config(rope_theta=500000.0)
    # head_dim 8, theta 5e5: wavelengths 6, 167, 4443, 118000 cover all three regimes of the
    # scaling (< 2048 kept, 2048..8192 blended, > 8192 divided by factor).
    factors = converter_rope_factors(500000.0, 8, 32.0, 1.0, 4.0, 8192)
    assert 1.0 < factors[2] < 32.0 and factors[0] == 1.0 and factors[3] == 32.0
    path = write_gguf(tmp_path / "tiny.gguf", config, flat(init_random_params(config)), rope_freqs=factors)
    loaded, _ = load_gguf(path)
    assert loaded.rope_scaling == Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position=8192)


def test_gguf_linear_rope_scaling(tmp_path):
    config = tiny_config()
    path = write_gguf(tmp_path / "tiny.gguf", config, flat(init_random_params(config)), linear_rope=4.0)
    loaded, _ = load_gguf(path)
    assert loaded.rope_scaling == LinearRopeScaling(4.0)
    assert ModelConfig.from_json(loaded.to_json()) == loaded  # as `jaxinfer convert` keeps it


def test_gguf_without_a_tokenizer_loads_for_token_ids(tmp_path):
    """As a directory without tokenizer files: the model loads with `tokenizer=None` and
    generates from token ids; text prompts are refused by name."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.loading import load_model
    from jaxinfer.sampling import SamplingParams

    config = tiny_config()
    path = write_gguf(tmp_path / "bare.gguf", config, flat(init_random_params(config)), tokenizer=False)
    model = load_model(path, weight_cache=False)
    assert model.tokenizer is None
    engine = Engine(model, EngineConfig(max_slots=1, page_size=8, max_model_len=32))
    assert len(engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text", SamplingParams(max_tokens=2))


def test_gguf_rope_freqs_of_unknown_parameters_rejected(tmp_path):
    config = tiny_config(rope_theta=500000.0)
    factors = converter_rope_factors(500000.0, 8, 8.0, 2.0, 4.0, 8192)  # low_freq_factor 2: not Llama 3's
    path = write_gguf(tmp_path / "tiny.gguf", config, flat(init_random_params(config)), rope_freqs=factors)
    with pytest.raises(CheckpointError) as excinfo:
        load_gguf(path)
    assert "rope_freqs.weight" in error_message(excinfo) and str(path) in error_message(excinfo)


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[Path, ModelConfig, ModelParams]:
    config = tiny_config()
    params = init_random_params(config, seed=2, scale=1.0)
    return write_gguf(tmp_path / "tiny.gguf", config, flat(params)), config, params


def write_broken_gguf(tmp_path, **kwargs) -> Path:
    config = tiny_config()
    return write_gguf(tmp_path / "broken.gguf", config, flat(init_random_params(config)), **kwargs)


GGUF_BREAKAGES = {
    "missing tensor": (dict(skip=("blk.1.ffn_up.weight",)), ["missing tensor 'blk.1.ffn_up.weight'"]),
    "missing field": (dict(skip=("block_count",)), ["missing metadata field 'llama.block_count'"]),
    "unsupported arch": (dict(arch="gpt2"), ["unsupported architecture", "general.architecture='gpt2'"]),
}


@pytest.mark.parametrize("case", list(GGUF_BREAKAGES))
def test_gguf_broken_file_raises_checkpoint_error(tmp_path, case):
    kwargs, expected = GGUF_BREAKAGES[case]
    path = write_broken_gguf(tmp_path, **kwargs)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    for fragment in expected:
        assert fragment in error_message(excinfo)
    assert str(path) in error_message(excinfo)


def test_gguf_wrong_shape(tmp_path):
    config = tiny_config()
    weights = flat(init_random_params(config))
    weights["layers.0.wk"] = np.zeros((8, 32), np.float32)
    path = write_gguf(tmp_path / "tiny.gguf", config, weights)
    with pytest.raises(CheckpointError) as excinfo:
        load_gguf(path)
    assert "'blk.0.attn_k.weight' has shape (8, 32), expected (16, 32)" in error_message(excinfo)


@pytest.mark.parametrize("keep_fraction", [0.01, 0.5, 0.999])
def test_gguf_truncated_file(tiny_gguf, tmp_path, keep_fraction):
    data = tiny_gguf[0].read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(CheckpointError) as excinfo:
        load_gguf(path)
    assert str(path) in error_message(excinfo) and "truncated or corrupt" in error_message(excinfo)


# --- the real model -----------------------------------------------------------------------------

SMOLLM2_CONFIG = ModelConfig(
    arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
    ffn_dim=1536, rope_theta=100000.0, rms_eps=1e-5, max_position=8192, tie_embeddings=True,
    bos_id=1, eos_ids=(2,),
)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> tuple[ModelConfig, ModelParams]:
    return load_gguf(smollm2_gguf)


@pytest.mark.slow
def test_smollm2_gguf_config_and_shapes(smollm2):
    config, params = smollm2
    assert config == SMOLLM2_CONFIG
    assert params.lm_head is None and len(params.layers) == 30
    assert params.embed.shape == (49152, 576) and params.layers[0].wk.shape == (192, 576)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(smollm2, smollm2_gguf):
    """transformers' own GGUF loader (its reverse permutation, its dequantization) agrees exactly."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert_matches_state_dict(*smollm2, state)


@pytest.mark.slow
def test_smollm2_tokenizer_survives_orbax_dir(smollm2_gguf, tmp_path):
    save_tokenizer(smollm2_gguf, tmp_path)  # what save_orbax(..., tokenizer=gguf_path) writes
    assert_same_tokenizer(Tokenizer.from_pretrained_dir(tmp_path), Tokenizer.from_gguf(smollm2_gguf))


# --- orbax -------------------------------------------------------------------------------------

TOKENIZER_TEXTS = ["hello there", "hell hello", "<|im_start|>hello<|im_end|>", "", "  he  ll "]


def assert_same_tokenizer(got: Tokenizer, want: Tokenizer) -> None:
    assert (got.bos_id, got.eos_ids, got.add_bos, got.chat_template) == (
        want.bos_id, want.eos_ids, want.add_bos, want.chat_template)
    assert got.vocab_size == want.vocab_size
    for text in TOKENIZER_TEXTS + ["The 2 quick brown foxes, naïvely: 123456!\n\tok"]:
        assert got.encode(text) == want.encode(text), text
        assert got.decode(want.encode(text), skip_special_tokens=False) == want.decode(
            want.encode(text), skip_special_tokens=False)


def test_orbax_round_trip(tmp_path):
    config = tiny_config("qwen2", tie_embeddings=False)  # biases and an untied head: every field
    params = init_random_params(config, seed=3)
    assert save_orbax(config, params, tmp_path / "ckpt") == (tmp_path / "ckpt").absolute()
    loaded_config, loaded = load_orbax(tmp_path / "ckpt")
    assert loaded_config == config
    assert_trees_equal(loaded, params)


def test_orbax_restore_casts_dtype_and_takes_shardings(tmp_path):
    config = tiny_config(rope_scaling=Llama3RopeScaling(), tie_embeddings=True)
    params = init_random_params(config, seed=4)
    save_orbax(config, params, tmp_path)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    loaded_config, loaded = load_orbax(tmp_path, dtype="bfloat16", shardings=sharding)
    assert loaded_config == config.replace(dtype="bfloat16")
    assert_trees_equal(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    assert all(leaf.sharding == sharding for leaf in jax.tree.leaves(loaded))


def test_orbax_save_refuses_foreign_dir_and_mismatched_params(tmp_path):
    config = tiny_config()
    params = init_random_params(config)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError):
        save_orbax(config, params, tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="structure"):
        save_orbax(config.replace(n_layers=3), params, tmp_path / "a")
    with pytest.raises(ValueError, match=r"params\.embed.*float32\[103, 32\].*\[103, 64\]"):
        save_orbax(config.replace(d_model=64), params, tmp_path / "b")
    save_orbax(config, params, tmp_path / "c")
    save_orbax(config, params, tmp_path / "c", overwrite=True)  # a jaxinfer checkpoint may be replaced
    assert_trees_equal(load_orbax(tmp_path / "c")[1], params)


def test_orbax_tokenizer_from_gguf(tiny_gguf, tmp_path):
    path, config, params = tiny_gguf
    save_orbax(*load_gguf(path), tmp_path / "ckpt", tokenizer=path)
    assert_same_tokenizer(Tokenizer.from_pretrained_dir(tmp_path / "ckpt"), Tokenizer.from_gguf(path))


def test_orbax_tokenizer_copied_from_hf_dir(tiny_gguf, tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    Tokenizer.from_gguf(tiny_gguf[0]).backend.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>",
                                                              "eos_token": "<|im_end|>"}))
    config, params = tiny_gguf[1:]
    save_orbax(config, params, tmp_path / "ckpt", tokenizer=hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "ckpt" / name).read_bytes() == (hf_dir / name).read_bytes()


def test_orbax_missing_params_and_bad_config(tmp_path):
    config = tiny_config()
    save_orbax(config, init_random_params(config), tmp_path / "a")
    shutil.rmtree(tmp_path / "a" / "params")
    with pytest.raises(CheckpointError, match="cannot restore orbax checkpoint"):
        load_checkpoint(tmp_path / "a")
    save_orbax(config, init_random_params(config), tmp_path / "t")
    data = max((f for f in (tmp_path / "t" / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # the largest data file, truncated
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(tmp_path / "t")
    message = error_message(excinfo)  # tensorstore's own error, in one line; not orbax's wrappers' spec dumps
    assert "cannot restore orbax checkpoint (truncated or corrupt?)" in message and "OUT_OF_RANGE" in message
    assert len(message.splitlines()) == 1 and "TensorStore" not in message
    save_orbax(config, init_random_params(config), tmp_path / "b")
    fields = json.loads((tmp_path / "b" / "config.json").read_text())
    del fields["n_heads"]
    (tmp_path / "b" / "config.json").write_text(json.dumps(fields))
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(tmp_path / "b")
    assert "config.json" in error_message(excinfo) and "'n_heads'" in error_message(excinfo)


# --- dispatch ----------------------------------------------------------------------------------


def test_load_checkpoint_dispatches_on_all_formats(tiny_gguf, llama_dir, tmp_path):
    gguf_path, config, params = tiny_gguf
    got_config, got = load_checkpoint(gguf_path)
    assert got_config == config
    assert_trees_equal(got, params)

    hf_config, hf_params = load_checkpoint(llama_dir[0])
    assert_matches_state_dict(hf_config, hf_params, llama_dir[1])

    # An orbax dir also has a config.json; the marker file decides.
    save_orbax(hf_config, hf_params, tmp_path / "orbax")
    orbax_config, orbax_params = load_checkpoint(tmp_path / "orbax")
    assert orbax_config == hf_config
    assert_trees_equal(orbax_params, hf_params)

    # A GGUF file is recognised by its magic even without the suffix.
    renamed = Path(shutil.copyfile(gguf_path, tmp_path / "model.bin"))
    assert load_checkpoint(renamed)[0] == config

    bf16_config, bf16_params = load_checkpoint(tmp_path / "orbax", dtype="bfloat16")
    assert bf16_config.dtype == "bfloat16" and bf16_params.embed.dtype == jnp.bfloat16


def test_load_checkpoint_rejects_unknown_and_missing_paths(tmp_path):
    missing = tmp_path / "nope"
    for load in (load_checkpoint, load_gguf, load_hf_dir, load_orbax):
        with pytest.raises(CheckpointError) as excinfo:
            load(missing)
        assert str(missing) in error_message(excinfo)
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_checkpoint(missing)
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    for path in (tmp_path / "empty", tmp_path / "notes.txt"):
        with pytest.raises(CheckpointError, match="unknown checkpoint format"):
            load_checkpoint(path)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    (tmp_path / "old" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: PyTorch pickles are not read"):
        load_checkpoint(tmp_path / "old")
