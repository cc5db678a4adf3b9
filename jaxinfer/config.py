"""Model configuration: frozen, hashable, safe to pass to `jax.jit` as a static argument."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gemma2", "gemma3",
                           "gpt_oss")
# Gemma 2/3 layers: RMS norms before and after attention and MLP, GeGLU (tanh GELU), embeddings
# scaled by sqrt(d_model); Gemma 3 adds RMS norms over each query and key head.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
SUPPORTED_DTYPES = ("float32", "bfloat16")
MOE_ACTIVATIONS = ("clamped_swiglu", "swiglu")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (HF `rope_type="llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (HF `rope_type="linear"`): every frequency divided by `factor`
    (Llama 2 long-context fine-tunes; Gemma 3 4B+ on its global layers)."""

    factor: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"LinearRopeScaling needs factor > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (HF `rope_type="yarn"`, gpt-oss): frequencies between the `beta_fast`
    and `beta_slow` rotation counts over `original_max_position` are blended from the base
    ones and the ones slowed by `factor`, and attention logits grow by `attention_factor`
    squared (HF multiplies cos and sin, so both q and k, by it)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1 (HF `yarn_get_mscale`)

    def __post_init__(self) -> None:
        if not self.factor > 0 or not self.original_max_position > 0:
            raise ValueError(f"YarnRopeScaling needs factor > 0 and original_max_position > 0, got {self}")

    @property
    def mscale(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP: each token's `n_experts` router logits pick its
    `experts_per_token` experts, weighted by a softmax over the chosen logits (or, with
    `normalize_weights=False`, their probabilities under a softmax over all experts: Qwen3-MoE's
    `norm_topk_prob: false`); each expert is a gated MLP of width `expert_dim`.

    `activation`: "clamped_swiglu" (gpt-oss: `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha
    * g)`, g = min(gate, limit)) or "swiglu" (Mixtral, Qwen3-MoE: `silu(gate) * up`). `bias`:
    the router and the experts have biases (gpt-oss)."""

    n_experts: int
    experts_per_token: int
    expert_dim: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    activation: str = "clamped_swiglu"
    bias: bool = True
    normalize_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("n_experts", "experts_per_token", "expert_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoEConfig.{name}={value!r} must be a positive integer")
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"MoEConfig.experts_per_token={self.experts_per_token} exceeds n_experts={self.n_experts}")
        if self.activation not in MOE_ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation={self.activation!r} must be one of {MOE_ACTIVATIONS}")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V2/V3 multi-head latent attention sizes (HF field names without `_head_dim`).

    Per token the cache holds `kv_lora_rank + qk_rope_dim` numbers per layer (the
    normalised latent `c_kv` and one RoPE key shared by all heads), not per-head K/V.
    `q_lora_rank=None` projects queries directly (DeepSeek-V2-Lite).
    """

    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLAConfig.{name}={value!r} must be a positive integer")
        if self.qk_rope_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_dim={self.qk_rope_dim} must be even for RoPE")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"MLAConfig.q_lora_rank={self.q_lora_rank!r} must be None or a positive integer")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    `head_dim` is explicit because some models (e.g. Qwen3, Gemma) do not use
    `d_model // n_heads`. Query heads must be a multiple of KV heads: MHA has
    `n_kv_heads == n_heads`, MQA has `n_kv_heads == 1`, GQA anything between.

    `layer_windows` is empty (every layer attends to its whole context) or holds one entry
    per layer: `None` for a global layer, `w` for a sliding-window layer whose query at
    position i sees keys i - w < j <= i (Mistral: all `w`; Gemma 2/3, Qwen2 `layer_types`:
    interleaved). `mla` switches attention to DeepSeek multi-head latent attention; then
    `n_kv_heads == n_heads` and `head_dim == mla.qk_head_dim`.

    Attention numerics: scores are `q . k * query_scale` (None: 1/sqrt(head_dim); Gemma:
    `query_pre_attn_scalar ** -0.5`), squashed to `cap * tanh(s / cap)` with `attn_softcap`
    (Gemma 2), and with `attn_sinks` each head adds its learned sink logit (`LayerParams.sinks`)
    to the softmax denominator (gpt-oss). `final_softcap` squashes the output logits alike.
    Windowed layers rotate with `rope_local_theta` when set (Gemma 3: local 10k, global 1M).
    RMS norm weights are stored as the factor they multiply by: Gemma's `(1 + w)` is folded in
    at load time (llama.cpp's converter does the same), so every arch shares one `rms_norm`.
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = False
    attn_bias: bool = False  # Qwen2 has biases on the q/k/v projections
    dtype: str = "float32"  # activation and weight dtype inside the forward
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    layer_windows: tuple[int | None, ...] = ()
    mla: MLAConfig | None = None
    query_scale: float | None = None
    rope_local_theta: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_sinks: bool = False
    attn_out_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    moe: MoEConfig | None = None  # the MLP is a mixture of experts (gpt-oss)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {SUPPORTED_DTYPES}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        for name in ("query_scale", "rope_local_theta", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r} must be None or positive")
        self._check_windows()
        self._check_mla()

    def _check_windows(self) -> None:
        windows = tuple(None if w is None else int(w) for w in self.layer_windows)
        object.__setattr__(self, "layer_windows", windows)
        if windows and len(windows) != self.n_layers:
            raise ValueError(f"layer_windows has {len(windows)} entries, expected n_layers={self.n_layers} (or none)")
        bad = [w for w in windows if w is not None and w <= 0]
        if bad:
            raise ValueError(f"layer_windows={windows} must hold None or positive window sizes")

    def _check_mla(self) -> None:
        if self.mla is None:
            if self.arch == "deepseek_v3":
                raise ValueError("arch='deepseek_v3' needs an MLAConfig (mla=...)")
            return
        if self.n_kv_heads != self.n_heads or self.head_dim != self.mla.qk_head_dim:
            raise ValueError(
                f"with MLA, n_kv_heads={self.n_kv_heads} must equal n_heads={self.n_heads} and "
                f"head_dim={self.head_dim} must equal qk_nope_dim + qk_rope_dim = {self.mla.qk_head_dim}"
            )
        if (self.layer_windows or self.attn_bias or self.is_gemma or self.attn_sinks or self.attn_softcap
                or self.attn_out_bias or self.moe):
            raise ValueError("MLA layers with sliding windows, attention biases, sinks, soft-caps, Gemma "
                             "norms or experts are not supported")

    def window(self, layer: int) -> int | None:
        """Sliding-window size of layer `layer` (None: the layer sees its whole context)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attention_scale(self) -> float:
        """Factor on q . k before the softmax (times YaRN's attention factor on q and on k)."""
        scale = 1.0 / math.sqrt(self.head_dim) if self.query_scale is None else self.query_scale
        return scale * self.rope_scaling.mscale**2 if isinstance(self.rope_scaling, YarnRopeScaling) else scale

    @property
    def is_gemma(self) -> bool:
        """Gemma 2/3 layer structure (`GEMMA_ARCHITECTURES`)."""
        return self.arch in GEMMA_ARCHITECTURES

    @property
    def qk_norm(self) -> bool:
        """RMS norm over each query and key head before RoPE (Gemma 3, Qwen3, Qwen3-MoE)."""
        return self.arch in ("gemma3", "qwen3", "qwen3_moe")

    @property
    def embed_scale(self) -> float | None:
        """Factor on the token embeddings (Gemma: sqrt(d_model)); None: no scaling."""
        return math.sqrt(self.d_model) if self.is_gemma else None

    @property
    def q_per_kv(self) -> int:
        """Query heads that share one KV head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        fields = json.loads(text)
        if fields.get("rope_scaling") is not None:
            scaling = fields["rope_scaling"]
            kind = (YarnRopeScaling if "beta_fast" in scaling else Llama3RopeScaling if "low_freq_factor" in scaling
                    else LinearRopeScaling)
            fields["rope_scaling"] = kind(**scaling)
        fields["eos_ids"] = tuple(fields.get("eos_ids", ()))
        fields["layer_windows"] = tuple(fields.get("layer_windows", ()))
        if fields.get("mla") is not None:
            fields["mla"] = MLAConfig(**fields["mla"])
        if fields.get("moe") is not None:
            fields["moe"] = MoEConfig(**fields["moe"])
        return cls(**fields)
