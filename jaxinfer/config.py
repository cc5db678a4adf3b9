"""Model configuration: frozen, hashable, safe to pass to `jax.jit` as a static argument."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (HF `rope_type="llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    `head_dim` is explicit because some models (e.g. Qwen3, Gemma) do not use
    `d_model // n_heads`. Query heads must be a multiple of KV heads: MHA has
    `n_kv_heads == n_heads`, MQA has `n_kv_heads == 1`, GQA anything between.
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
    rope_scaling: Llama3RopeScaling | None = None
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = False
    attn_bias: bool = False  # Qwen2 has biases on the q/k/v projections
    dtype: str = "float32"  # activation and weight dtype inside the forward
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()

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
            fields["rope_scaling"] = Llama3RopeScaling(**fields["rope_scaling"])
        fields["eos_ids"] = tuple(fields.get("eos_ids", ()))
        return cls(**fields)
