"""KV-cache bytes per token for every attention variant, from one function.

Per layer and cached token the cache holds::

    MHA / GQA / MQA   2 * n_kv_heads * head_dim     (K and V; MQA: n_kv_heads = 1)
    MLA               kv_lora_rank + qk_rope_dim    (latent c_kv + the shared RoPE key)

and a layer holds this for min(n, held) of a sequence's n tokens: held = n (global layer),
the layer's window w (sliding window, pages behind it released), or S + W (a StreamingLLM
sink + recent cache). Counted in tokens: page rounding adds less than one page per layer.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv.streaming import StreamingSpec


def kv_elements_per_token(config: ModelConfig) -> int:
    """Cache elements one token occupies in one layer."""
    if config.mla is not None:
        return config.mla.kv_lora_rank + config.mla.qk_rope_dim
    return 2 * config.n_kv_heads * config.head_dim


def kv_bytes_per_token(config: ModelConfig, context_len: int | None = None, *,
                       streaming: StreamingSpec | None = None, dtype: str | None = None) -> float:
    """Average cache bytes per token, summed over layers, for a sequence of `context_len` tokens.

    Without windows or `streaming` every token costs the same and `context_len` may be
    omitted; otherwise the cost per token falls as the context grows past the window, so
    `context_len` is required. `dtype` defaults to `config.dtype`.
    """
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    per_layer = kv_elements_per_token(config) * itemsize
    bounded = streaming is not None or any(w is not None for w in config.layer_windows)
    if context_len is None:
        if bounded:
            raise ValueError("context_len is required with sliding windows or a streaming cache")
        return float(per_layer * config.n_layers)
    if not isinstance(context_len, int) or context_len <= 0:
        raise ValueError(f"context_len={context_len!r} must be a positive integer")
    if streaming is not None:  # the ring holds S + W tokens in every layer, windowed or not
        held = config.n_layers * min(context_len, streaming.capacity)
    else:
        held = sum(min(context_len, config.window(i) or context_len) for i in range(config.n_layers))
    return per_layer * held / context_len
