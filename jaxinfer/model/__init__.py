"""The model: config, parameters and the pure forward pass."""

from jaxinfer.model.params import LayerParams, ModelParams, build_params, init_random_params
from jaxinfer.model.transformer import forward, lm_head

__all__ = ["LayerParams", "ModelParams", "build_params", "forward", "init_random_params", "lm_head"]
