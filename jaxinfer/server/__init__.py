"""OpenAI-compatible HTTP server over the engine (`jaxinfer serve`)."""

from jaxinfer.server.app import OpenAIServer, create_app
from jaxinfer.server.loop import EngineLoop, QueueFull
from jaxinfer.server.serve import DrainingServer, build_server, serve

__all__ = ["DrainingServer", "EngineLoop", "OpenAIServer", "QueueFull", "build_server", "create_app", "serve"]
