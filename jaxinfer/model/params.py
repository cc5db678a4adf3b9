"""Model parameters as a pytree of plain arrays.

Linear weights are stored `[out_features, in_features]` (the HF/GGUF row layout); the
forward multiplies `x @ w.T`. On XLA:CPU this [N, K] layout is the faster one for one-row
gemvs, and it means loaders copy tensors without transposing; an engine on CPU also keeps
the dense layers' weights and the LM head in two more layouts for its multi-row products
(`with_gemm_weights`, `jaxinfer.model.layers.LinearLayouts`).
Layers are a tuple with one pytree per layer, or (the stacked layout, `jaxinfer.layer_stack`)
one per run of alike layers with a leading layer axis, which the forward scans over.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import layer_stack
from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import DEFAULT_READS, LinearLayouts, check_reads


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [d_model]
    wq: jax.Array  # [n_heads * head_dim, d_model]
    wk: jax.Array  # [n_kv_heads * head_dim, d_model]
    wv: jax.Array  # [n_kv_heads * head_dim, d_model]
    wo: jax.Array  # [d_model, n_heads * head_dim]
    mlp_norm: jax.Array  # [d_model]
    w_gate: jax.Array | None = None  # [ffn_dim, d_model]     (None: experts, `moe_*`)
    w_up: jax.Array | None = None  # [ffn_dim, d_model]
    w_down: jax.Array | None = None  # [d_model, ffn_dim]
    bq: jax.Array | None = None  # [n_heads * head_dim]     (Qwen2 only)
    bk: jax.Array | None = None  # [n_kv_heads * head_dim]  (Qwen2 only)
    bv: jax.Array | None = None  # [n_kv_heads * head_dim]  (Qwen2 only)
    q_norm: jax.Array | None = None  # [head_dim]: RMS norm over each query head (Gemma 3, Qwen3)
    k_norm: jax.Array | None = None  # [head_dim]: RMS norm over each key head (Gemma 3, Qwen3)
    post_attn_norm: jax.Array | None = None  # [d_model]: on the attention output (Gemma 2/3)
    post_mlp_norm: jax.Array | None = None  # [d_model]: on the MLP output (Gemma 2/3)
    sinks: jax.Array | None = None  # [n_heads]: learned sink logit per query head (gpt-oss)
    bo: jax.Array | None = None  # [d_model]: attention output bias (gpt-oss)
    # A mixture of experts instead of w_gate/w_up/w_down (`ModelConfig.moe`): E experts of width
    # I; expert weights are stored [in, out] as gpt-oss checkpoints hold them, and each expert's
    # gate and up columns alternate (gate 0, up 0, gate 1, ...); the HF loader brings Mixtral's
    # and Qwen3-MoE's per-expert [out, in] matrices to this layout. Biases: gpt-oss only.
    moe_router: jax.Array | None = None  # [E, d_model]
    moe_router_bias: jax.Array | None = None  # [E]
    moe_gate_up: jax.Array | None = None  # [E, d_model, 2 * I]
    moe_gate_up_bias: jax.Array | None = None  # [E, 2 * I]
    moe_down: jax.Array | None = None  # [E, I, d_model]
    moe_down_bias: jax.Array | None = None  # [E, d_model]


@struct.dataclass
class MLALayerParams:
    """A DeepSeek-V2/V3 layer: multi-head latent attention + a dense SwiGLU MLP.

    H = n_heads, r = kv_lora_rank, dn/dr = qk_nope/qk_rope dims, dv = v_head_dim. Rows of
    each head's q rope part and of the k rope part are in rotate-half order (the loader
    un-interleaves DeepSeek's `rope_interleave` layout).
    """

    attn_norm: jax.Array  # [d_model]
    wkv_a: jax.Array  # [r + dr, d_model]: latent, then the shared rope key
    kv_a_norm: jax.Array  # [r]
    wkv_b: jax.Array  # [H * (dn + dv), r]: per head, k_nope rows then v rows
    wo: jax.Array  # [d_model, H * dv]
    mlp_norm: jax.Array  # [d_model]
    w_gate: jax.Array  # [ffn_dim, d_model]
    w_up: jax.Array  # [ffn_dim, d_model]
    w_down: jax.Array  # [d_model, ffn_dim]
    wq: jax.Array | None = None  # [H * (dn + dr), d_model]            (q_lora_rank None)
    wq_a: jax.Array | None = None  # [q_lora_rank, d_model]            (q_lora_rank set)
    q_a_norm: jax.Array | None = None  # [q_lora_rank]
    wq_b: jax.Array | None = None  # [H * (dn + dr), q_lora_rank]


def layer_class(config: ModelConfig) -> type:
    """The per-layer params pytree class `build_params` makes for `config`."""
    return LayerParams if config.mla is None else MLALayerParams


@struct.dataclass
class ModelParams:
    embed: jax.Array  # [vocab_size, d_model]
    layers: tuple[LayerParams | MLALayerParams, ...] | tuple[layer_stack.LayerStack, ...]  # per layer, or per run
    final_norm: jax.Array  # [d_model]
    lm_head: jax.Array | None = None  # [vocab_size, d_model]; None when tied to `embed`


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every per-layer tensor (keys are `layer_class(config)` field names)."""
    c = config
    if c.mla is not None:
        return _mla_shapes(c)
    shapes = {
        "attn_norm": (c.d_model,),
        "wq": (c.n_heads * c.head_dim, c.d_model),
        "wk": (c.n_kv_heads * c.head_dim, c.d_model),
        "wv": (c.n_kv_heads * c.head_dim, c.d_model),
        "wo": (c.d_model, c.n_heads * c.head_dim),
        "mlp_norm": (c.d_model,),
    }
    if c.moe is None:
        shapes |= {"w_gate": (c.ffn_dim, c.d_model), "w_up": (c.ffn_dim, c.d_model), "w_down": (c.d_model, c.ffn_dim)}
    else:
        e, i = c.moe.n_experts, c.moe.expert_dim
        shapes |= {"moe_router": (e, c.d_model), "moe_gate_up": (e, c.d_model, 2 * i), "moe_down": (e, i, c.d_model)}
        if c.moe.bias:
            shapes |= {"moe_router_bias": (e,), "moe_gate_up_bias": (e, 2 * i), "moe_down_bias": (e, c.d_model)}
    if c.attn_out_bias:
        shapes |= {"bo": (c.d_model,)}
    if c.attn_bias:
        shapes |= {
            "bq": (c.n_heads * c.head_dim,),
            "bk": (c.n_kv_heads * c.head_dim,),
            "bv": (c.n_kv_heads * c.head_dim,),
        }
    if c.qk_norm:
        shapes |= {"q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    if c.is_gemma:
        shapes |= {"post_attn_norm": (c.d_model,), "post_mlp_norm": (c.d_model,)}
    if c.attn_sinks:
        shapes |= {"sinks": (c.n_heads,)}
    return shapes


def _mla_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    m, h = c.mla, c.n_heads
    shapes = {
        "attn_norm": (c.d_model,),
        "wkv_a": (m.kv_lora_rank + m.qk_rope_dim, c.d_model),
        "kv_a_norm": (m.kv_lora_rank,),
        "wkv_b": (h * (m.qk_nope_dim + m.v_head_dim), m.kv_lora_rank),
        "wo": (c.d_model, h * m.v_head_dim),
        "mlp_norm": (c.d_model,),
        "w_gate": (c.ffn_dim, c.d_model),
        "w_up": (c.ffn_dim, c.d_model),
        "w_down": (c.d_model, c.ffn_dim),
    }
    if m.q_lora_rank is None:
        return shapes | {"wq": (h * m.qk_head_dim, c.d_model)}
    return shapes | {"wq_a": (m.q_lora_rank, c.d_model), "q_a_norm": (m.q_lora_rank,),
                     "wq_b": (h * m.qk_head_dim, m.q_lora_rank)}


def build_params(config: ModelConfig, get, *, dtype=None, place=None, layer_runs: tuple[int, ...] | None = None
                 ) -> ModelParams:
    """Assemble `ModelParams` from a lookup `get(name, shape) -> np.ndarray`.

    Names are `embed`, `final_norm`, `lm_head` and `layers.{i}.{field}`. Every loader
    (GGUF, HF, random init) goes through here, so shape checks live in one place:
    a mismatch raises `ValueError` naming the tensor. `place(config, name, array)` puts
    each tensor where it belongs as soon as it is read (e.g. straight into its shards on
    a mesh: `jaxinfer.sharding.placer`); default: the default device.

    `layer_runs`: build the stacked layout (`jaxinfer.model.stacking.layer_runs`), each run's
    tensors stacked on the host and placed once as `layers.{first}:{stop}.{field}` [n, ...].
    """
    dtype = jnp.dtype(dtype or config.dtype)

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = np.asarray(get(name, shape))
        if array.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {array.shape}, expected {shape}")
        return array

    def put(name: str, array: np.ndarray) -> jax.Array:
        if place is not None:
            return place(config, name, array.astype(dtype))
        return jnp.asarray(array, dtype=dtype)

    def fetch(name: str, shape: tuple[int, ...]) -> jax.Array:
        return put(name, read(name, shape))

    layer_shapes = expected_shapes(config)
    cls = layer_class(config)
    if layer_runs is None:
        layers = tuple(
            cls(**{f: fetch(f"layers.{i}.{f}", s) for f, s in layer_shapes.items()})
            for i in range(config.n_layers)
        )
    else:
        bounds = np.cumsum((0, *layer_runs))
        if bounds[-1] != config.n_layers:
            raise ValueError(f"layer_runs={tuple(layer_runs)} do not cover the {config.n_layers} layers")
        def run(a: int, b: int) -> layer_stack.LayerStack:  # read layer by layer (the order `get` sees is layout-free)
            tensors = [{f: read(f"layers.{i}.{f}", s).astype(dtype) for f, s in layer_shapes.items()} for i in range(a, b)]
            return layer_stack.LayerStack(cls(**{f: put(f"layers.{a}:{b}.{f}", np.stack([t[f] for t in tensors]))
                                                 for f in layer_shapes}))

        layers = tuple(run(a, b) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    vd = (config.vocab_size, config.d_model)
    return ModelParams(
        embed=fetch("embed", vd),
        layers=layers,
        final_norm=fetch("final_norm", (config.d_model,)),
        lm_head=None if config.tie_embeddings else fetch("lm_head", vd),
    )


def init_random_params(config: ModelConfig, seed: int = 0, scale: float = 0.02,
                       layer_runs: tuple[int, ...] | None = None) -> ModelParams:
    """Random weights for tests and examples (norm weights near one)."""
    rng = np.random.default_rng(seed)

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm"):
            return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        return scale * rng.standard_normal(shape, dtype=np.float32)

    return build_params(config, get, layer_runs=layer_runs)


GEMM_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the dense layers' linear weights
GEMM_GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"))  # weights one input multiplies (`linears`)


def gemm_weights(layer) -> dict[str, jax.Array]:
    """A dense layer's linear weights by name (`GEMM_WEIGHTS`; none for MLA layers and experts)."""
    if not isinstance(layer, LayerParams):
        return {}
    return {name: w for name in GEMM_WEIGHTS if isinstance(w := getattr(layer, name), jax.Array)}


def lm_head_weight(params: ModelParams) -> jax.Array:
    """[vocab_size, d_model]: the LM head's weight (the embedding when tied) in the checkpoint's layout."""
    w = params.embed if params.lm_head is None else params.lm_head
    return w.nk if isinstance(w, LinearLayouts) else w


def with_gemm_weights(params: ModelParams, reads: tuple[str, str] = DEFAULT_READS) -> ModelParams:
    """`params` with each dense layer's linear weights and the LM head also stored in the
    layouts XLA:CPU's multi-row products (verify blocks, batches, prefill chunks) read without
    re-laying the weight out every call (`jaxinfer.model.layers.LinearLayouts`), one and few
    rows reading the layouts `reads` names. Copies those weights twice (a tied LM head keeps
    the embedding as its `nk`), and where one row reads `kn` also q/k/v and gate/up side by
    side (`LinearLayouts.group`); MLA layers, experts and the embedding are left as they are.
    Params already in all layouts get `reads` and keep their arrays."""

    def all_layouts(layer):
        if not isinstance(layer, LayerParams):
            return layer
        layer = layer.replace(**{name: _with_reads(w, reads) for name in GEMM_WEIGHTS
                                 if isinstance(w := getattr(layer, name), (jax.Array, LinearLayouts))})
        for names in GEMM_GROUPS:  # one row reading `kn` reads each group in one gemv (`linears`)
            ws = [getattr(layer, name) for name in names]
            if all(isinstance(w, LinearLayouts) for w in ws):
                group = jnp.concatenate([w.kn for w in ws], axis=-1) if reads[0] == "kn" else None
                layer = layer.replace(**{names[0]: dataclasses.replace(ws[0], group=group)})
        return layer

    head = params.lm_head if isinstance(params.lm_head, LinearLayouts) else lm_head_weight(params)
    return params.replace(layers=_map_layers(all_layouts, params.layers), lm_head=_with_reads(head, reads))


def _with_reads(w: jax.Array | LinearLayouts, reads: tuple[str, str]) -> LinearLayouts:
    if isinstance(w, LinearLayouts):
        return dataclasses.replace(w, reads=check_reads(reads))
    return LinearLayouts.of(w, reads)


def without_gemm_weights(params: ModelParams) -> ModelParams:
    """`params` in the checkpoint's layout only: `with_gemm_weights` undone (a tied LM head
    is None again), e.g. to save an engine's params."""

    def one_layout(layer):
        return layer.replace(**{f.name: w.nk for f in dataclasses.fields(layer)
                                if isinstance(w := getattr(layer, f.name), LinearLayouts)})

    head = params.lm_head.nk if isinstance(params.lm_head, LinearLayouts) else params.lm_head
    return params.replace(layers=_map_layers(one_layout, params.layers), lm_head=None if head is params.embed else head)


def _map_layers(fn, layers: tuple) -> tuple:
    """fn applied to each layer's params, a stacked run's as one."""
    return tuple(layer_stack.LayerStack(fn(x.stacked)) if isinstance(x, layer_stack.LayerStack) else fn(x) for x in layers)
