"""What an engine is built with (`EngineConfig`) and what it reports (`EngineMetrics`)."""

from __future__ import annotations

import dataclasses
import os

from jaxinfer.attention.dispatch import IMPLS
from jaxinfer.kv.plan import kv_cache_choice
from jaxinfer.kv.streaming import StreamingSpec
from jaxinfer.model.layers import check_reads
from jaxinfer.model.stacking import LAYER_LOOPS, WEIGHT_LAYOUTS
from jaxinfer.reasoning import find_reasoning_parser
from jaxinfer.speculative.config import SpeculativeConfig, SpeculativeStats


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes fixed for the engine's lifetime (they set every compiled shape)."""

    max_slots: int = 8  # sequences resident at once
    page_size: int = 16
    max_model_len: int | None = None  # default: min(model context, 2048)
    num_pages: int | None = None  # default: enough for every slot at max_model_len
    prefill_chunk: int = 64  # tokens per prefill row per step
    max_prefill_rows: int = 1  # prefill rows per step (on a mesh: rounded up to a multiple of `data`)
    max_tokens_per_step: int | None = None  # token budget; default: everything that fits
    enable_prefix_caching: bool = True
    # or "static": admit a new batch only when all are done; a static batch keeps all
    # max_slots decode rows until then, as transformers' `generate` does (unless
    # `decode_row_buckets` is given)
    scheduling: str = "continuous"
    seed: int = 0  # draws seeds for requests that bring none
    # (S, W): a bounded StreamingLLM cache per sequence, S sinks + the W most recent tokens;
    # sequences may then run past max_model_len and the model's context (no prefix caching).
    streaming: tuple[int, int] | None = None
    # A jax.sharding.Mesh with axes ("data", "model") (`jaxinfer.sharding.make_mesh`): params
    # and pages split over heads on `model`, slots over `data`. None = one device.
    mesh: object | None = None
    # Paged attention: "auto" (the kernels on GPU/TPU where they apply, the reference on CPU;
    # a program whose kernel fails to compile on the device warns once and runs the reference),
    # "reference" (pure jnp), "pallas" (the kernels; interpret mode on CPU) or "pallas_gpu" /
    # "pallas_tpu" (one target's kernels). See `jaxinfer.attention.dispatch`.
    attention_impl: str = "auto"
    # KV-cache storage: "auto" (model dtype), a format name for every layer ("int8",
    # "fp8_e4m3", "int4", ...), a `jaxinfer.kv.plan.KVCachePlan` or a plan JSON path
    # (`jaxinfer calibrate-kv`). Invalid names or plans raise ValueError.
    kv_cache: object = "auto"
    # Speculative decoding (`SpeculativeConfig`: n-gram, self-speculation, a draft model or an
    # EAGLE head; or vLLM's `speculative_config` dict, `SpeculativeConfig.from_vllm`);
    # None = one token per decoding slot per step.
    speculative: SpeculativeConfig | None = None
    # jax's persistent compilation cache, so a second start compiles nothing: True =
    # $JAXINFER_CACHE/xla (off when the environment sets JAXINFER_COMPILATION_CACHE=0),
    # a directory, or False. Process-wide: a cache directory already given to jax is kept.
    compilation_cache: bool | str | os.PathLike = True
    # How the step loops over layers: "unroll" (every layer in the program), "scan" (one
    # `lax.scan` per run of alike layers: compile time and program size independent of depth)
    # or "auto" (unroll on CPU, where unrolled layers decode faster; scan on GPU/TPU).
    layer_loop: str = "auto"
    # Linear weights in one layout ("one": [out, in], as checkpoints store them) or "all"
    # (also as column panels and transposed, `jaxinfer.model.params.with_gemm_weights`:
    # XLA:CPU's products of 2+ rows, i.e. verify blocks, batches and prefill chunks, then
    # skip re-laying the weight out every call, for three times the dense layers' weight
    # memory); "auto": "all" on one CPU device when the two copies take at most 2 GiB, else
    # "one" (`jaxinfer.model.stacking.resolve_weight_layouts`).
    weight_layouts: str = "auto"
    # With weight_layouts "all": the layout a product of one row and of 2-6 rows reads,
    # e.g. ("nk", "panels") or ("kn", "kn") (`jaxinfer.model.layers.READS`). The fastest
    # differs between CPUs, not only shapes; "auto" times them once on this machine for the
    # model's shapes and remembers the answer (`jaxinfer.model.row_layouts`).
    row_layouts: str | tuple[str, str] = "auto"
    # Tokens the narrowest context bucket holds: the step's block tables are cut to the
    # smallest of these widths (x4 each, up to max_model_len) that fits every sequence.
    min_context_bucket: int = 512
    # Decode rows the decode-only programs are compiled for (vLLM's padded batch sizes): a
    # step with n decoding requests runs the smallest bucket >= n, so one request on an
    # 8-slot engine steps at the cost of one row, not eight. None = 1, 4, 16, ... up to
    # max_slots / 4 (8 slots: 1 and 8; 16 slots: 1, 4 and 16; just max_slots for "static"
    # scheduling); max_slots is always added. Each bucket is one more program per context
    # bucket (and draft width, with speculation) to compile: `(max_slots,)` compiles the
    # fewest. Steps with prefill rows, a mesh's `data` axis and speculation on a mesh keep
    # row b = slot b at max_slots rows.
    decode_row_buckets: tuple[int, ...] | None = None
    # Asynchronous scheduling (vLLM v1's `async_scheduling`): `Engine.step` dispatches step
    # n + 1 before it reads step n's tokens, so the host's scheduling, batch building and
    # detokenizing overlap the device's work. Step n + 1's decode rows take their input token
    # from step n's output on the device; `step` returns step n's outputs (one step late). A
    # request that finishes at step n wastes its row of step n + 1. Plain decoding only.
    async_scheduling: bool = False
    # A reasoning model's convention ("qwen3", "deepseek_r1": `jaxinfer.reasoning`, vLLM's
    # `--reasoning-parser`): structured output leaves its <think>...</think> free and
    # constrains the answer after it.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_slots", "page_size", "prefill_chunk", "max_prefill_rows", "min_context_bucket"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name}={value!r} must be a positive integer")
        for name in ("max_model_len", "num_pages", "max_tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"EngineConfig.{name}={value!r} must be None or a positive integer")
        if self.decode_row_buckets is not None:
            rows = self.decode_row_buckets
            if (not isinstance(rows, tuple) or not rows
                    or not all(isinstance(r, int) and 0 < r <= self.max_slots for r in rows)):
                raise ValueError(f"EngineConfig.decode_row_buckets={rows!r} must be None or a non-empty tuple of "
                                 f"integers in [1, max_slots={self.max_slots}]")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"EngineConfig.async_scheduling={self.async_scheduling!r} must be True or False")
        find_reasoning_parser(self.reasoning_parser)
        if self.attention_impl not in IMPLS:
            raise ValueError(f"EngineConfig.attention_impl={self.attention_impl!r} must be one of {IMPLS}")
        if self.weight_layouts not in WEIGHT_LAYOUTS:
            raise ValueError(f"EngineConfig.weight_layouts={self.weight_layouts!r} must be one of {WEIGHT_LAYOUTS}")
        if self.row_layouts != "auto":
            try:
                check_reads(self.row_layouts)
            except ValueError as e:
                raise ValueError(f"EngineConfig.row_layouts={self.row_layouts!r} must be 'auto' or a pair: {e}") from None
            if self.weight_layouts == "one":
                raise ValueError("EngineConfig.row_layouts names layouts that only weight_layouts 'all' (or 'auto' on "
                                 "one CPU device) stores; with weight_layouts='one' leave it 'auto'")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"EngineConfig.layer_loop={self.layer_loop!r} must be one of {LAYER_LOOPS}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"EngineConfig.scheduling={self.scheduling!r} must be 'continuous' or 'static'")
        if self.streaming is not None:
            if not isinstance(self.streaming, tuple) or len(self.streaming) != 2:
                raise ValueError(f"EngineConfig.streaming={self.streaming!r} must be None or a pair (sinks, window)")
            StreamingSpec(*self.streaming)  # validates both
        if not isinstance(self.compilation_cache, (bool, str, os.PathLike)):
            raise ValueError(f"EngineConfig.compilation_cache={self.compilation_cache!r} must be True, False or a directory")
        choice = kv_cache_choice(self.kv_cache, self.page_size)  # a bad name, plan file or page size: refused here
        if isinstance(self.kv_cache, (list, tuple)):  # per-layer names: kept as their (hashable) plan
            object.__setattr__(self, "kv_cache", choice)
        if isinstance(self.speculative, dict):  # vLLM's `speculative_config` form
            object.__setattr__(self, "speculative", SpeculativeConfig.from_vllm(self.speculative))
        if self.speculative is not None:
            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError(f"EngineConfig.speculative must be a SpeculativeConfig, vLLM's speculative_config "
                                 f"dict or None, got {self.speculative!r}")
            if self.streaming is not None:
                raise ValueError("speculative decoding is not supported with streaming caches")
            if self.async_scheduling:
                raise ValueError("async_scheduling=True is not supported with speculative decoding (the "
                                 "number of tokens a step keeps is known only once it has run)")


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    running: int
    waiting: int
    pages_used: int
    pages_free: int
    pages_cached: int
    # the windowed layers' own pool of a hybrid model (`jaxinfer.kv.window_ring`): a ring per
    # slot, held by running requests; 0 when every layer uses the pages above
    window_pages_used: int
    window_pages_total: int
    prefix_hit_rate: float  # cached full prompt pages / full prompt pages looked up
    prefix_hits: int
    prefix_queries: int
    preemptions: int
    steps: int
    compiled_programs: int  # step programs XLA compiled for this engine (not another engine's, not loaded)
    cached_programs: int = 0  # step programs loaded from the persistent compilation cache instead
    speculative: SpeculativeStats | None = None  # acceptance per position, tokens per target forward

    @property
    def obtained_programs(self) -> int:
        """Programs this engine compiled or loaded from the persistent cache: constant in steady state."""
        return self.compiled_programs + self.cached_programs
