"""Load a GGUF file (llama.cpp's format) into `ModelConfig` + `ModelParams`.

Layout facts (checked on the SmolLM2 Q4_1 file): ggml lists dims fastest axis first
(`[576, 49152]` for the embedding); `jaxinfer.gguf_file` reverses them, and
`gguf.quants.dequantize(tensor.data, tensor.type)` yields numpy arrays in row order
`[rows, cols]` = `[out, in]` (`[49152, 576]`), which is already our HF layout. Quantized
tensors are dequantized to float32 one at a time, then cast to `dtype`.

Dequantizing costs seconds per load, so `weight_cache=True` keeps the result on disk
(`jaxinfer.checkpoint.weight_cache`) and later loads memory-map it instead.

llama.cpp's converter stores the q and k projection rows of `llama` models in its own
order (see `unpermute_rows`); we undo that so every loader yields the same HF layout and the
forward uses one RoPE convention (rotate-half). `qwen2` files are not permuted.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxinfer.checkpoint import progress as progress_bar
from jaxinfer.checkpoint import weight_cache as cache
from jaxinfer.checkpoint.errors import CheckpointError, as_checkpoint_error
from jaxinfer.config import SUPPORTED_DTYPES, LinearRopeScaling, Llama3RopeScaling, ModelConfig, MoEConfig
from jaxinfer.gguf_file import GGUFFile, GGUFTensor, read_gguf
from jaxinfer.model.params import ModelParams, build_params

# general.architecture -> whether q/k rows are in llama.cpp's permuted order.
_QK_PERMUTED = {"llama": True, "qwen2": False, "qwen3": False, "qwen3moe": False, "gemma2": False, "gemma3": False}
# general.architecture -> `ModelConfig.arch`, where they differ (a "llama" file with experts is Mixtral's)
_ARCH_NAMES = {"qwen3moe": "qwen3_moe"}
# Gemma 2/3: every `pattern`-th layer is global, the rest windowed (llama.cpp `set_swa_pattern`;
# a `{arch}.attention.sliding_window_pattern` key overrides); windowed Gemma 3 layers rotate with
# base 10000 (llama.cpp `rope_freq_base_train_swa`, key `{arch}.rope.freq_base_swa`).
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp scales queries by 1/sqrt(d_model / n_heads) instead of 1/sqrt(head_dim) for the
# 27B models only, which it recognises by their depth (`LLM_TYPE_27B`).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Gemma stops a chat turn at this token; its GGUF files carry no eot id (llama.cpp finds it by text).
_GEMMA_END_OF_TURN = "<end_of_turn>"

_GLOBAL_TENSORS = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}
_LAYER_TENSORS = {  # LayerParams field -> name inside `blk.{i}.`
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "post_mlp_norm": "post_ffw_norm.weight",
    "moe_router": "ffn_gate_inp.weight",
}
# Experts, stacked [E, out, in] per matrix as llama.cpp's converter writes them: gate, up, down
_EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# Bump when the tensors `load_gguf` produces change (names, layout, dequantization): weight
# caches written by another version are then rebuilt.
LOADER_VERSION = 1
# Tensor types read as they are; any other type is dequantized, which is worth caching.
_FLOAT_TYPES = frozenset(gguf.GGMLQuantizationType[t] for t in ("F32", "F16", "BF16"))
_REQUIRED = object()  # `field` default: a missing key is an error
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def load_gguf(
    source: str | os.PathLike | GGUFFile,
    dtype: str = "float32",
    place=None,
    *,
    weight_cache: bool = False,
    progress: bool = False,
) -> tuple[ModelConfig, ModelParams]:
    """Read config and weights from a GGUF file (a path, or one already read with
    `open_gguf_checked`); weights come back in HF layout, in `dtype`.

    Supports `general.architecture` `llama` (also Mistral and Mixtral files), `qwen2`, `qwen3`,
    `qwen3moe`, `gemma2` and `gemma3` (text; llama.cpp's converter already stored Gemma's norm
    weights as `1 + w`). Raises
    `CheckpointError` naming the file and the field or tensor for anything it cannot load.
    `weight_cache=True`: read the dequantized weights from the weight cache, or write them
    there (quantized files only; `$JAXINFER_NO_WEIGHT_CACHE` overrides). `progress`: a bar on
    stderr if reading the weights takes over 2 s.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {SUPPORTED_DTYPES}")
    gguf_file = source if isinstance(source, GGUFFile) else open_gguf_checked(Path(source))
    path, tensors = gguf_file.path, gguf_file.tensors
    gguf_arch = gguf_file.metadata.get("general.architecture")
    config = config_from_gguf(gguf_file.metadata, tensors, path).replace(dtype=dtype)
    np_dtype = np.dtype(config.jnp_dtype)  # cast here, so that the weight cache holds the final arrays

    def read(gguf_name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = _dequantize(tensors, gguf_name, path)
        if array.shape != shape:
            raise CheckpointError(f"{path}: tensor {gguf_name!r} has shape {array.shape}, expected {shape}")
        return array

    def dequantized(name: str, shape: tuple[int, ...]) -> np.ndarray:
        field = name.rsplit(".", 1)[-1]
        if field in ("moe_gate_up", "moe_down"):
            return _experts(read, name, config).astype(np_dtype, copy=False)
        array = read(_gguf_tensor_name(name), shape)
        if _QK_PERMUTED[gguf_arch] and field in ("wq", "bq", "wk", "bk"):
            array = unpermute_rows(array, config.n_heads if field in ("wq", "bq") else config.n_kv_heads)
        return array.astype(np_dtype, copy=False)

    use_cache = weight_cache and cache.enabled() and any(t.type not in _FLOAT_TYPES for t in tensors.values())
    with contextlib.ExitStack() as stack, as_checkpoint_error(path):
        get = dequantized
        if use_cache:
            get = stack.enter_context(cache.cached(weight_cache_key(path, dtype), get))
        get = stack.enter_context(progress_bar.counting(get, _n_params(tensors), f"loading {path.name}", progress))
        return config, build_params(config, get, place=place)


def weight_cache_key(path: Path, dtype: str) -> cache.CacheKey:
    """Where `load_gguf(path, dtype, weight_cache=True)` caches its tensors, and what for."""
    return cache.cache_key(path, dtype, f"jaxinfer load_gguf v{LOADER_VERSION}, gguf {version('gguf')}")


def open_gguf_checked(path: Path) -> GGUFFile:
    """`read_gguf(path)` with its failures (missing, truncated, corrupt) as `CheckpointError`."""
    try:
        return read_gguf(path)
    except FileNotFoundError as error:
        raise CheckpointError(str(error)) from error
    except ValueError as error:
        raise CheckpointError(f"{error} (truncated or corrupt?)") from error


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, GGUFTensor], path: Path) -> ModelConfig:
    """Build the `ModelConfig` from GGUF metadata (`GGUFFile.metadata`).

    `tensors` (name -> `GGUFTensor`) decides tying (no `output.weight`), q/k/v biases,
    Llama 3 RoPE scaling (`rope_freqs.weight`) and, as a last resort, the vocabulary size.
    """
    arch = meta.get("general.architecture")
    if arch not in _QK_PERMUTED:
        raise CheckpointError(
            f"{path}: unsupported architecture general.architecture={arch!r}; "
            f"supported: {sorted(_QK_PERMUTED)}"
        )

    def field(key: str, default: Any = _REQUIRED) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is _REQUIRED:
            raise CheckpointError(f"{path}: missing metadata field '{arch}.{key}'")
        if isinstance(value, list):
            raise CheckpointError(f"{path}: per-layer metadata field '{arch}.{key}' is not supported")
        return value

    moe = None
    if field("expert_count", 0):
        if arch not in ("llama", "qwen3moe") or field("expert_shared_count", 0):
            raise CheckpointError(f"{path}: mixture-of-experts ({arch}.expert_count) is supported for llama "
                                  "(Mixtral) and qwen3moe files, without shared experts")
        with as_checkpoint_error(path):  # llama.cpp renormalises the chosen experts' weights for both
            moe = MoEConfig(n_experts=int(field("expert_count")), experts_per_token=int(field("expert_used_count")),
                            expert_dim=int(field("expert_feed_forward_length", field("feed_forward_length"))),
                            activation="swiglu", bias=False)
    d_model = int(field("embedding_length"))
    n_heads = int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", d_model // n_heads))
    rope_dims = int(field("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise CheckpointError(
            f"{path}: partial rotary ({arch}.rope.dimension_count={rope_dims} != head_dim={head_dim}) "
            "is not supported"
        )
    rope_theta = _f32(field("rope.freq_base", 10000.0))
    n_layers = int(field("block_count"))
    gemma = _gemma_fields(meta, arch, n_layers, d_model // n_heads, head_dim, path) if arch in _GEMMA_SWA_PATTERN else {}
    with as_checkpoint_error(path):
        return ModelConfig(
            arch="mixtral" if arch == "llama" and moe else _ARCH_NAMES.get(arch, arch),
            vocab_size=_vocab_size(meta, tensors, arch, path),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(field("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn_dim=int(field("feed_forward_length", moe.expert_dim if moe else _REQUIRED)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(meta, tensors, arch, rope_theta, head_dim, path),
            rms_eps=_f32(field("attention.layer_norm_rms_epsilon")),
            max_position=int(field("context_length")),
            tie_embeddings="output.weight" not in tensors,
            attn_bias="blk.0.attn_q.bias" in tensors,
            moe=moe,
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_ids=tuple(dict.fromkeys(meta[k] for k in _EOS_KEYS if meta.get(k) is not None)) + gemma.pop("eot", ()),
            **gemma,
        )


def _gemma_fields(meta, arch: str, n_layers: int, d_per_head: int, head_dim: int, path: Path) -> dict[str, Any]:
    """Gemma 2/3 `ModelConfig` fields llama.cpp derives from the architecture rather than reading
    (see the module constants), plus `eot`: the end-of-turn id to stop at."""
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None:
        raise CheckpointError(f"{path}: missing metadata field '{arch}.attention.sliding_window'")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_SWA_PATTERN[arch])
    if isinstance(pattern, list):  # one bool per layer, True = windowed
        if len(pattern) != n_layers:
            raise CheckpointError(f"{path}: '{arch}.attention.sliding_window_pattern' has {len(pattern)} entries "
                                  f"for {n_layers} layers")
        windowed = [bool(p) for p in pattern]
    else:
        windowed = [bool((i + 1) % int(pattern)) for i in range(n_layers)]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    softcaps = {key: meta.get(f"{arch}.{name}") for key, name in
                (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping"))}
    return {
        "layer_windows": tuple(int(window) if w else None for w in windowed),
        "query_scale": (d_per_head if n_layers == _GEMMA_27B_LAYERS[arch] else head_dim) ** -0.5,
        "rope_local_theta": _f32(meta.get(f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)) if arch == "gemma3" else None,
        **{key: None if value is None else _f32(value) for key, value in softcaps.items()},
        "eot": (tokens.index(_GEMMA_END_OF_TURN),) if _GEMMA_END_OF_TURN in tokens else (),
    }


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` on q or k rows (weight `[H*D, in]` or bias `[H*D]`).

    HF rotates pairs (j, j + D/2) within each head (rotate-half RoPE); the converter moves
    each pair next to each other for llama.cpp's interleaved RoPE. For head h, half s, i < D/2:

        HF row    h*D + s*(D/2) + i        e.g. D=4:  HF [a0 a1 | b0 b1]
        GGUF row  h*D + 2*i + s                       GGUF [a0 b0 a1 b1]

    The converter's permute is `reshape(H, 2, D/2, ...).swapaxes(1, 2)`; the inverse is
    `reshape(H, D/2, 2, ...).swapaxes(1, 2)`.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors(scaling: Llama3RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors that Llama 3 RoPE scaling applies (what llama.cpp's converter
    writes as `rope_freqs.weight`): 1 for short wavelengths, `factor` for long ones, a smooth
    blend between. Returns f64[head_dim // 2]."""
    s = scaling
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(s.factor)
        else:
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            divisors.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.array(divisors)


def _rope_scaling(meta, tensors, arch, theta, head_dim, path) -> Llama3RopeScaling | LinearRopeScaling | None:
    """RoPE scaling of a GGUF file: none, linear (`rope.scaling.type` "linear" with its
    `rope.scaling.factor`; on Gemma 3 the global layers only, as in llama.cpp), or Llama 3
    style stored as `rope_freqs.weight`.

    The file keeps only the divisors, not HF's parameters. We take `factor` = the largest
    divisor, assume the values every released Llama 3.x uses for the rest (low 1, high 4,
    original context 8192), and accept them only if they reproduce the stored divisors.
    """
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear" and "rope_freqs.weight" not in tensors:
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
        return None if factor == 1.0 else LinearRopeScaling(factor)
    if scaling_type != "none":
        raise CheckpointError(f"{path}: unsupported RoPE scaling {arch}.rope.scaling.type={scaling_type!r}")
    if "rope_freqs.weight" not in tensors:
        return None
    divisors = _dequantize(tensors, "rope_freqs.weight", path).reshape(-1).astype(np.float64)
    if np.all(divisors == 1.0):
        return None
    candidate = Llama3RopeScaling(factor=float(divisors.max()))
    expected = llama3_rope_divisors(candidate, theta, head_dim)
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-5, atol=0):
        raise CheckpointError(
            f"{path}: tensor 'rope_freqs.weight' does not match Llama 3 RoPE scaling with "
            f"factor={candidate.factor}, low_freq_factor=1, high_freq_factor=4, original context 8192"
        )
    return candidate


def _vocab_size(meta, tensors, arch, path) -> int:
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    if "tokenizer.ggml.tokens" in meta:
        return len(meta["tokenizer.ggml.tokens"])
    if "token_embd.weight" in tensors:
        return int(tensors["token_embd.weight"].shape[0])  # [vocab, d_model]
    raise CheckpointError(f"{path}: cannot tell the vocabulary size ({arch}.vocab_size, token list missing)")


def _gguf_tensor_name(name: str) -> str:
    """Our parameter name (`embed`, `layers.3.wq`) -> GGUF tensor name (`blk.3.attn_q.weight`)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    _, layer, field = name.split(".")
    return f"blk.{layer}.{_LAYER_TENSORS[field]}"


def _experts(read: Callable[[str, tuple[int, ...]], np.ndarray], name: str, config: ModelConfig) -> np.ndarray:
    """`layers.i.moe_gate_up` ([E, d_model, 2I], gate and up columns alternating) or
    `layers.i.moe_down` ([E, I, d_model]) from the file's stacked [E, out, in] experts."""
    prefix = f"blk.{name.split('.')[1]}."
    e, d, i = config.moe.n_experts, config.d_model, config.moe.expert_dim
    gate, up, down = (prefix + t for t in _EXPERT_TENSORS)
    if name.endswith("moe_down"):
        return read(down, (e, d, i)).transpose(0, 2, 1)
    return np.stack([read(gate, (e, i, d)), read(up, (e, i, d))], axis=-1).transpose(0, 2, 1, 3).reshape(e, d, 2 * i)


def _n_params(tensors: dict[str, GGUFTensor]) -> int:
    """How many tensors `build_params` will ask for: all but extras such as `rope_freqs`."""
    params = set(_GLOBAL_TENSORS.values())
    return sum(name in params or name.startswith("blk.") for name in tensors)


def _dequantize(tensors: dict[str, GGUFTensor], name: str, path: Path) -> np.ndarray:
    if name not in tensors:
        raise CheckpointError(f"{path}: missing tensor {name!r}")
    tensor = tensors[name]
    try:
        return gguf.quants.dequantize(tensor.data, tensor.type)
    except NotImplementedError as error:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported type {tensor.type.name}") from error


def _f32(value: float) -> float:
    """GGUF stores floats as f32; take the shortest decimal that round-trips (1e-5, not
    9.999999747378752e-06), which is the value the model was published with."""
    return float(str(np.float32(value)))
