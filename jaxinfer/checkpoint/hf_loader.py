"""Load a Hugging Face model directory (`config.json` + safetensors) into `ModelConfig` +
`ModelParams`.

Weights are read with `safetensors.safe_open(..., framework="flax")` under a CPU default
device: numpy cannot represent bfloat16 (`framework="numpy"` raises `TypeError: data type
'bfloat16' not understood`), while the flax reader returns jax arrays of any stored dtype,
which `build_params` casts to `dtype`. Keeping them on the CPU device means a GPU/TPU only
ever sees the cast result. Linear weights are already `[out, in]`; nothing is transposed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors

from jaxinfer.checkpoint.errors import CheckpointError, as_checkpoint_error
from jaxinfer.config import (GEMMA_ARCHITECTURES, SUPPORTED_DTYPES, LinearRopeScaling, Llama3RopeScaling, MLAConfig,
                             ModelConfig, MoEConfig, RopeScaling, YarnRopeScaling)
from jaxinfer.model.params import ModelParams, build_params

# HF `architectures[0]` -> our `ModelConfig.arch`.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
}
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"

_LAYER_TENSORS = {  # LayerParams field -> name inside `model.layers.{i}.`
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    # DeepSeek-V3 multi-head latent attention (MLALayerParams)
    "wq_a": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "wq_b": "self_attn.q_b_proj.weight",
    "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "wkv_b": "self_attn.kv_b_proj.weight",
}
# Gemma 2/3 name their norms around attention and MLP differently: `post_attention_layernorm`
# is the norm on the attention output, `pre_feedforward_layernorm` the one before the MLP.
_GEMMA_LAYER_TENSORS = _LAYER_TENSORS | {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
# Qwen3: Llama's layer plus RMS norms over each query and key head (plain `w`, not Gemma's
# `1 + w`); `attention_bias` adds biases on all four projections
_QWEN3_LAYER_TENSORS = _LAYER_TENSORS | {
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "bo": "self_attn.o_proj.bias",
}
# Mixtral and Qwen3-MoE: one [out, in] matrix per expert e (gate, up, down), and the router
_MOE_LAYER_TENSORS = {
    "mixtral": _LAYER_TENSORS | {"moe_router": "block_sparse_moe.gate.weight"},
    "qwen3_moe": _QWEN3_LAYER_TENSORS | {"moe_router": "mlp.gate.weight"},
}
_EXPERT_TENSORS = {
    "mixtral": ("block_sparse_moe.experts.{}.w1.weight", "block_sparse_moe.experts.{}.w3.weight",
                "block_sparse_moe.experts.{}.w2.weight"),
    "qwen3_moe": ("mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight", "mlp.experts.{}.down_proj.weight"),
}
# gpt-oss: biases on every attention projection, learned sinks, a mixture of experts
_GPT_OSS_LAYER_TENSORS = _LAYER_TENSORS | {
    "bo": "self_attn.o_proj.bias",
    "sinks": "self_attn.sinks",
    "moe_router": "mlp.router.weight",
    "moe_router_bias": "mlp.router.bias",
    "moe_gate_up": "mlp.experts.gate_up_proj",
    "moe_gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "moe_down": "mlp.experts.down_proj",
    "moe_down_bias": "mlp.experts.down_proj_bias",
}
_GLOBAL_TENSORS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def is_hf_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and (
        (path / SINGLE_FILE).is_file() or (path / SHARD_INDEX).is_file()
    )


def load_hf_dir(path: str | os.PathLike, dtype: str = "float32", place=None) -> tuple[ModelConfig, ModelParams]:
    """Read `config.json` and `model.safetensors` (or the shards listed in
    `model.safetensors.index.json`) from an HF model directory; weights come back in `dtype`.

    Supports LlamaForCausalLM, MistralForCausalLM (with its `sliding_window`),
    Qwen2ForCausalLM and Qwen3ForCausalLM (with `layer_types` / `use_sliding_window`; Qwen3's
    QK norms and optional `attention_bias`), MixtralForCausalLM and Qwen3MoeForCausalLM (every
    MLP a mixture of experts), DeepseekV3ForCausalLM
    with dense MLP layers only (`first_k_dense_replace >= num_hidden_layers`), and
    Gemma2ForCausalLM / Gemma3ForCausalLM (text; their `(1 + w)` norm weights are stored
    as `1 + w`, see `ModelConfig`) and the language model of Gemma3ForConditionalGeneration
    (Gemma 3 4B+; `_text_model`), and GptOssForCausalLM with dequantized weights (attention
    biases and sinks, a mixture of experts, YaRN RoPE; not the MXFP4 release files). Raises
    `CheckpointError` naming the file and the field or tensor for anything it cannot load.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {SUPPORTED_DTYPES}")
    path = Path(path)
    hf, stored_names = _text_model(_read_json(path / "config.json"), _weight_map(path), path / "config.json")
    weight_map = {name: file for name, (_, file) in stored_names.items()}
    config = config_from_hf(hf, path / "config.json", has_lm_head="lm_head.weight" in weight_map)
    config = config.replace(eos_ids=_merge_eos(config.eos_ids, path), dtype=dtype)

    with contextlib.ExitStack() as stack, jax.default_device(jax.devices("cpu")[0]):
        handles: dict[Path, Any] = {}
        read: set[str] = set()

        def stored(tensor_name: str, shape: tuple[int, ...]):
            """One tensor of the checkpoint, its shape checked."""
            if tensor_name not in weight_map:
                raise CheckpointError(f"{path}: missing tensor {tensor_name!r}")
            read.add(tensor_name)
            name, file = stored_names[tensor_name]
            file = path / file
            if file not in handles:
                handles[file] = stack.enter_context(_safe_open(file))
            try:
                stored_shape = tuple(handles[file].get_slice(name).get_shape())
                if stored_shape != shape:
                    raise CheckpointError(f"{file}: tensor {name!r} has shape {stored_shape}, expected {shape}")
                return handles[file].get_tensor(name)
            except safetensors.SafetensorError as error:
                raise CheckpointError(f"{file}: tensor {name!r}: {error}") from error

        def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
            if config.arch in _EXPERT_TENSORS and name.endswith(("moe_gate_up", "moe_down")):
                return _stacked_experts(config, name, stored)
            tensor = _deinterleave_rope(config, hf, name, stored(_hf_tensor_name(config, name), shape))
            return np.asarray(tensor).astype(np.float32) + 1 if config.is_gemma and name.endswith("norm") else tensor

        with as_checkpoint_error(path):
            params = build_params(config, get, place=place)
    _warn_unused(path, config, set(weight_map) - read)
    return config, params


def _stacked_experts(config: ModelConfig, name: str, stored: Callable[[str, tuple[int, ...]], Any]) -> np.ndarray:
    """`layers.i.moe_gate_up` / `layers.i.moe_down` from Mixtral's or Qwen3-MoE's per-expert
    [out, in] matrices: [E, d_model, 2I] with gate and up columns alternating / [E, I, d_model]."""
    prefix = f"model.layers.{name.split('.')[1]}."
    gate, up, down = (prefix + t for t in _EXPERT_TENSORS[config.arch])
    e, d, i = config.moe.n_experts, config.d_model, config.moe.expert_dim
    if name.endswith("moe_down"):
        return np.stack([np.asarray(stored(down.format(x), (d, i))).T for x in range(e)])
    return np.stack([np.stack([np.asarray(stored(gate.format(x), (i, d))).T, np.asarray(stored(up.format(x), (i, d))).T],
                              axis=-1).reshape(d, 2 * i) for x in range(e)])


def _warn_unused(path: Path, config: ModelConfig, unused: set[str]) -> None:
    """Tensors the config does not read are most often a config that does not match its
    weights (fewer layers than stored): say so, as transformers does, without refusing."""
    unused = {name for name in unused if not name.endswith("rotary_emb.inv_freq")}  # old RoPE buffers
    if not unused:
        return
    layers = {int(m.group(1)) for name in unused if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    hint = (f"; the weights hold {max(layers) + 1} layers but config.json has num_hidden_layers={config.n_layers}, "
            f"so only the first {config.n_layers} run"
            if layers and min(layers) >= config.n_layers else "")
    names = sorted(unused)
    warnings.warn(f"{path}: {len(names)} tensors are not used by its config ({', '.join(names[:3])}"
                  f"{', ...' if len(names) > 3 else ''}){hint}", stacklevel=3)


def config_from_hf(hf: dict[str, Any], file: Path, *, has_lm_head: bool = True) -> ModelConfig:
    """Translate an HF `config.json` dict. `has_lm_head` decides tying when the config does
    not say (`tie_word_embeddings` absent): tied exactly when there is no `lm_head.weight`."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise CheckpointError(
            f"{file}: unsupported architecture architectures={archs!r}; supported: {sorted(ARCHITECTURES | _MULTIMODAL)}"
        )
    arch = ARCHITECTURES[archs[0]]
    if arch in _WINDOW_DEFAULTS:  # a config that leaves these out reads as transformers reads it
        hf = _over_defaults(hf, _WINDOW_DEFAULTS[arch])

    def field(key: str) -> Any:
        return _required(hf, key, file)

    _reject_unsupported(hf, arch, file)
    n_heads = int(field("num_attention_heads"))
    rope, local_theta = _rope_dict(hf, arch, file)
    mla = _mla_config(hf, file) if arch == "deepseek_v3" else None
    gemma, gpt_oss = arch in GEMMA_ARCHITECTURES, arch == "gpt_oss"
    # biases on q/k/v and o: gpt-oss's and Qwen3's `attention_bias` (defaults True / False)
    out_bias = ((gpt_oss and bool(_optional(hf, "attention_bias", True)))
                or (arch in ("qwen3", "qwen3_moe") and bool(hf.get("attention_bias"))))
    with as_checkpoint_error(file):
        return ModelConfig(
            arch=arch,
            vocab_size=int(field("vocab_size")),
            d_model=int(field("hidden_size")),
            n_layers=int(field("num_hidden_layers")),
            n_heads=n_heads,
            n_kv_heads=n_heads if mla else int(hf.get("num_key_value_heads") or n_heads),
            head_dim=mla.qk_head_dim if mla else int(hf.get("head_dim") or field("hidden_size") // n_heads),
            ffn_dim=int(field("intermediate_size")),
            rope_theta=float(_optional(hf, "rope_theta", _optional(rope, "rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(rope, arch, file),
            rms_eps=float(_optional(hf, "rms_norm_eps", 1e-6)),
            max_position=int(field("max_position_embeddings")),
            tie_embeddings=bool(_optional(hf, "tie_word_embeddings", not has_lm_head)),
            attn_bias=arch == "qwen2" or out_bias,  # Qwen2: q/k/v only, always
            attn_out_bias=out_bias,
            attn_sinks=gpt_oss,
            moe=_moe_config(hf, arch, file) if arch in ("gpt_oss", "mixtral", "qwen3_moe") else None,
            bos_id=hf.get("bos_token_id"),
            eos_ids=_as_ids(hf.get("eos_token_id")),
            layer_windows=_layer_windows(hf, arch, int(field("num_hidden_layers")), file),
            mla=mla,
            query_scale=float(field("query_pre_attn_scalar")) ** -0.5 if gemma else None,
            rope_local_theta=local_theta,
            # transformers' Gemma 3 attention ignores `attn_logit_softcapping` (its configs leave it null)
            attn_softcap=None if arch == "gemma3" else _optional_float(hf, "attn_logit_softcapping"),
            final_softcap=_optional_float(hf, "final_logit_softcapping"),
        )


def _optional(hf: dict[str, Any], key: str, default: Any) -> Any:
    """`hf[key]`, or `default` where it is absent or null (as transformers reads a null)."""
    return default if hf.get(key) is None else hf[key]


def _required(hf: dict[str, Any], key: str, file: Path) -> Any:
    if hf.get(key) is None:
        raise CheckpointError(f"{file}: missing config field {key!r}")
    return hf[key]


def _moe_config(hf: dict[str, Any], arch: str, file: Path) -> MoEConfig:
    """The experts: how many, how many per token, their width and activation (gpt-oss: a
    clamped SwiGLU with biases; Mixtral, Qwen3-MoE: SwiGLU)."""
    if arch == "qwen3_moe":
        if int(hf.get("decoder_sparse_step") or 1) != 1 or hf.get("mlp_only_layers"):
            raise CheckpointError(f"{file}: dense MLP layers among the experts (decoder_sparse_step="
                                  f"{hf.get('decoder_sparse_step')!r}, mlp_only_layers={hf.get('mlp_only_layers')!r}) "
                                  "are not supported")
        keys = ("num_experts" if "num_experts" in hf else "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
    else:
        keys = ("num_local_experts", "num_experts_per_tok", "intermediate_size")
    n_experts, per_token, width = (int(_required(hf, key, file)) for key in keys)
    with as_checkpoint_error(file):
        if arch != "gpt_oss":
            return MoEConfig(n_experts=n_experts, experts_per_token=per_token, expert_dim=width, activation="swiglu",
                             bias=False, normalize_weights=arch == "mixtral" or bool(hf.get("norm_topk_prob", False)))
        return MoEConfig(n_experts=n_experts, experts_per_token=per_token, expert_dim=width,
                         swiglu_alpha=float(_optional(hf, "swiglu_alpha", 1.702)), swiglu_limit=float(_optional(hf, "swiglu_limit", 7.0)))


def _optional_float(hf: dict[str, Any], key: str) -> float | None:
    return None if hf.get(key) is None else float(hf[key])


def _layer_windows(hf: dict[str, Any], arch: str, n_layers: int, file: Path) -> tuple[int | None, ...]:
    """Per-layer sliding windows: Mistral windows every layer by `sliding_window`; Qwen2/3 (and
    any config with `layer_types`) windows the layers typed "sliding_attention"."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = None  # Qwen2/3 ignore sliding_window unless use_sliding_window (HF Qwen2Config, Qwen3Config)
    if types is None and window and arch in ("qwen2", "qwen3", "qwen3_moe"):  # older configs, as transformers reads them
        first = int(_optional(hf, "max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if types is None and arch in GEMMA_ARCHITECTURES:  # older configs: every `pattern`-th layer is global
        pattern = int(hf.get("sliding_window_pattern") or (6 if arch == "gemma3" else 2))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if types is None:
        return (int(window),) * n_layers if window and arch in ("mistral", "mixtral") else ()
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != n_layers:
        raise CheckpointError(f"{file}: unsupported config field layer_types={types!r} "
                              f"(need {n_layers} of 'full_attention' / 'sliding_attention')")
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def _mla_config(hf: dict[str, Any], file: Path) -> MLAConfig:
    """DeepSeek-V3 attention sizes; MoE layers and YaRN-scaled attention are rejected."""
    n_layers = int(hf.get("num_hidden_layers") or 0)
    if hf.get("n_routed_experts") and int(hf.get("first_k_dense_replace") or 0) < n_layers:
        raise CheckpointError(f"{file}: mixture-of-experts layers are not supported (need "
                              f"first_k_dense_replace={hf.get('first_k_dense_replace')} >= num_hidden_layers={n_layers})")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _required(hf, key, file)
    with as_checkpoint_error(file):
        return MLAConfig(kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_dim=int(hf["qk_nope_head_dim"]),
                         qk_rope_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                         q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]))


def _deinterleave_rope(config: ModelConfig, hf: dict[str, Any], name: str, tensor):
    """DeepSeek's `rope_interleave` pairs rope channels (0, 1), (2, 3), ...; reorder the rows
    that produce rope channels to (0, 2, 4, ..., 1, 3, 5, ...) so the rotate-half RoPE of
    `apply_rope` gives the same dot products (HF `apply_rotary_pos_emb_interleave`)."""
    field = name.rsplit(".", 1)[-1]
    if config.mla is None or not _optional(hf, "rope_interleave", True) or field not in ("wq", "wq_b", "wkv_a"):
        return tensor
    m = config.mla
    order = np.concatenate([np.arange(0, m.qk_rope_dim, 2), np.arange(1, m.qk_rope_dim, 2)])
    if field == "wkv_a":
        return np.concatenate([np.asarray(tensor[: m.kv_lora_rank]), np.asarray(tensor[m.kv_lora_rank :])[order]])
    heads = np.asarray(tensor).reshape(config.n_heads, m.qk_head_dim, -1)
    rope = heads[:, m.qk_nope_dim :][:, order]
    return np.concatenate([heads[:, : m.qk_nope_dim], rope], axis=1).reshape(tensor.shape)


def _reject_unsupported(hf: dict[str, Any], arch: str, file: Path) -> None:
    """Fail on config switches whose weights or math `ModelParams` cannot express."""
    if arch in GEMMA_ARCHITECTURES:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise CheckpointError(f"{file}: unsupported config field hidden_activation={act!r} (need 'gelu_pytorch_tanh')")
        if hf.get("use_bidirectional_attention"):
            raise CheckpointError(f"{file}: unsupported config field use_bidirectional_attention=true (a decoder needs "
                                  "causal attention)")
    elif _optional(hf, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"{file}: unsupported config field hidden_act={hf['hidden_act']!r} (need 'silu')")
    for key in ("attention_bias", "mlp_bias"):  # Llama's switches; they also add o_proj/down biases
        if not (arch in ("qwen2", "gpt_oss") or (arch in ("qwen3", "qwen3_moe") and key == "attention_bias")) and hf.get(key):
            raise CheckpointError(f"{file}: unsupported config field {key}=true")
    if hf.get("quantization_config") is not None:  # gpt-oss releases: MXFP4 experts
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        raise CheckpointError(f"{file}: quantized checkpoints (quantization_config quant_method={method!r}) are not "
                              "supported; give one with dequantized (bf16/f32) weights")


def _rope_dict(hf: dict[str, Any], arch: str, file: Path) -> tuple[dict[str, Any], float | None]:
    """-> (the global layers' RoPE parameters, the windowed layers' RoPE base or None: the same).

    transformers >= 5 writes `rope_parameters` (with `rope_theta` inside), for Gemma 3 one dict
    per layer type; older configs have `rope_scaling` plus a top-level `rope_theta` (Gemma 3:
    and `rope_local_base_freq`, default 10000)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if arch != "gemma3":
        return rope, None
    if "full_attention" not in rope:
        return rope, float(_optional(hf, "rope_local_base_freq", 10000.0))
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise CheckpointError(f"{file}: unsupported RoPE scaling of the sliding layers "
                              f"rope_parameters.sliding_attention={local!r}")
    return rope["full_attention"], float(_optional(local, "rope_theta", 10000.0))


# HF's YaRN as gpt-oss and the Llama / Qwen families use it (DeepSeek's also rescales the softmax by
# `mscale`: not supported; Gemma's local layers would need their own)
_YARN_ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss")


def _rope_scaling(rope: dict[str, Any], arch: str, file: Path) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "yarn" and arch in _YARN_ARCHITECTURES:
        if rope.get("mscale") or rope.get("mscale_all_dim") or rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"{file}: unsupported YaRN fields in {rope!r} (mscale / partial_rotary_factor)")
        for key in ("factor", "original_max_position_embeddings"):
            if rope.get(key) is None:
                raise CheckpointError(f"{file}: yarn RoPE scaling is missing config field {key!r}")
        return YarnRopeScaling(factor=float(rope["factor"]), original_max_position=int(rope["original_max_position_embeddings"]),
                               beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                               truncate=bool(rope.get("truncate", True)),
                               attention_factor=None if rope.get("attention_factor") is None else float(rope["attention_factor"]))
    if rope_type == "linear":
        if rope.get("factor") is None:
            raise CheckpointError(f"{file}: linear RoPE scaling is missing config field 'factor'")
        return LinearRopeScaling(factor=float(rope["factor"]))
    if rope_type != "llama3":
        also = f" (yarn: for {', '.join(_YARN_ARCHITECTURES)})" if rope_type == "yarn" else ""
        also += " (dynamic NTK scaling changes a sequence's frequencies as it grows: its cached keys would go stale)" \
            if rope_type == "dynamic" else ""
        raise CheckpointError(f"{file}: unsupported RoPE scaling rope_type={rope_type!r}{also}")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for key in keys:
        if key not in rope:
            raise CheckpointError(f"{file}: llama3 RoPE scaling is missing config field {key!r}")
    return Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position=int(rope["original_max_position_embeddings"]),
    )


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _merge_eos(eos_ids: tuple[int, ...], path: Path) -> tuple[int, ...]:
    """Append `generation_config.json`'s eos ids (instruct models often list their
    end-of-turn token only there)."""
    gen_file = path / "generation_config.json"
    extra = _as_ids(_read_json(gen_file).get("eos_token_id")) if gen_file.is_file() else ()
    return tuple(dict.fromkeys(eos_ids + extra))


# multimodal checkpoints whose text model is served: architectures[0] -> the text model's
_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# transformers' Gemma3TextConfig defaults, which the released Gemma 3 4B+ configs leave out of
# their `text_config`
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}


# transformers' Gemma2Config / Gemma3TextConfig defaults for the fields that decide which layers
# are windowed and how they rotate: left out, a model would run all-global with another RoPE base
_WINDOW_DEFAULTS = {
    "gemma2": {"sliding_window": 4096},
    "gemma3": {key: _GEMMA3_TEXT_DEFAULTS[key] for key in ("sliding_window", "rope_theta", "rope_local_base_freq")},
}


def _over_defaults(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`config` over `defaults`; a default RoPE base gives way to one inside the RoPE parameters."""
    merged = defaults | config
    rope = merged.get("rope_parameters") or merged.get("rope_scaling") or {}
    if "rope_theta" not in config and "rope_theta" in (rope.get("full_attention") or rope):
        merged.pop("rope_theta", None)
    return merged


def _text_model(hf: dict[str, Any], weight_map: dict[str, str], file: Path
                ) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """-> (the config of the text model, its tensors: our HF name -> (stored name, file)). A
    multimodal checkpoint (Gemma 3 4B+: `Gemma3ForConditionalGeneration`) serves its language
    model: `text_config` over transformers' defaults, the tensors under `language_model.`
    (or `model.language_model.`, as transformers 4.5x saved them); the vision tower is not read."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in _MULTIMODAL:
        return hf, {name: (name, f) for name, f in weight_map.items()}
    if not isinstance(hf.get("text_config"), dict):
        raise CheckpointError(f"{file}: architectures={archs!r} needs a 'text_config'")
    text = _over_defaults(hf["text_config"], _GEMMA3_TEXT_DEFAULTS) | {
        k: hf[k] for k in ("eos_token_id", "bos_token_id") if k in hf}
    names = {}
    for name, f in weight_map.items():
        if name.startswith("language_model."):  # language_model.model.layers.0... -> model.layers.0...
            names[name.removeprefix("language_model.")] = (name, f)
        elif name.startswith("model.language_model."):
            names["model." + name.removeprefix("model.language_model.")] = (name, f)
        elif name == "lm_head.weight":
            names[name] = (name, f)
    return text | {"architectures": [_MULTIMODAL[archs[0]]]}, names


def _weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to `path`)."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such model directory")
    if (path / SHARD_INDEX).is_file():
        index = _read_json(path / SHARD_INDEX)
        if not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{path / SHARD_INDEX}: missing field 'weight_map'")
        return index["weight_map"]
    if (path / SINGLE_FILE).is_file():
        with _safe_open(path / SINGLE_FILE) as handle:
            return {name: SINGLE_FILE for name in handle.keys()}
    raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {SHARD_INDEX} found")


@contextlib.contextmanager
def _safe_open(file: Path):
    if not file.is_file():
        raise CheckpointError(f"{file}: no such safetensors file")
    try:
        handle = safetensors.safe_open(file, framework="flax")
    except safetensors.SafetensorError as error:
        raise CheckpointError(f"{file}: cannot read safetensors file (truncated or corrupt?): {error}") from error
    with handle:
        yield handle


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: cannot read JSON: {error}") from error


def _hf_tensor_name(config: ModelConfig, name: str) -> str:
    """Our parameter name (`embed`, `layers.3.wq`) -> HF name (`model.layers.3.self_attn.q_proj.weight`)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    _, layer, field = name.split(".")
    table = (_GEMMA_LAYER_TENSORS if config.is_gemma else _GPT_OSS_LAYER_TENSORS if config.arch == "gpt_oss"
             else _QWEN3_LAYER_TENSORS if config.arch == "qwen3" else _MOE_LAYER_TENSORS.get(config.arch, _LAYER_TENSORS))
    return f"model.layers.{layer}.{table[field]}"
