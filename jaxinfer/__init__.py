"""jaxinfer: functional LLM inference in JAX over a fixed-shape paged KV cache."""

from jaxinfer.config import Llama3RopeScaling, ModelConfig
from jaxinfer.engine import CompletionOutput, Engine, EngineConfig, RequestOutput
from jaxinfer.kv import KVCacheSpec, PageAllocator, PagedKVState, init_paged_kv
from jaxinfer.loading import Model, load_model
from jaxinfer.model import ModelParams, forward
from jaxinfer.sampling import SamplingParams
from jaxinfer.speculative import DraftModel, SpeculativeConfig
from jaxinfer.structured_output import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "CompletionOutput",
    "DraftModel",
    "Engine",
    "EngineConfig",
    "KVCacheSpec",
    "Llama3RopeScaling",
    "Model",
    "ModelConfig",
    "ModelParams",
    "PageAllocator",
    "PagedKVState",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "forward",
    "init_paged_kv",
    "load_model",
]
