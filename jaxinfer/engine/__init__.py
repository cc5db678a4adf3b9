"""The serving engine: slot-based continuous batching over one jitted step."""

from jaxinfer.engine.config import EngineConfig, EngineMetrics
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.speculative.config import SpeculativeConfig

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "EngineMetrics", "RequestMetrics", "RequestOutput", "SpeculativeConfig"]
