"""The model: config, parameters and the pure forward pass."""

from jaxinfer.model.params import LayerParams, ModelParams, build_params, init_random_params
from jaxinfer.model.transformer import TokenGroup, forward, forward_groups, forward_hidden, lm_head

__all__ = ["LayerParams", "ModelParams", "TokenGroup", "build_params", "forward", "forward_groups", "forward_hidden", "init_random_params", "lm_head"]
