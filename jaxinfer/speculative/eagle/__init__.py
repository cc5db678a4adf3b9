"""EAGLE speculative decoding: a one-layer draft head over the target's own features.

    head        EagleParams / EagleHead (the head and the target parts it borrows), bind_head
    step        eagle_step: draft with the head, verify, carry the features (jitted)
    checkpoint  save_eagle_head / load_eagle_head (orbax), DEFAULT_EAGLE_PATH

Training lives in `jaxinfer.speculative.train.eagle` (`jaxinfer train-draft --kind eagle`).
"""

from jaxinfer.speculative.eagle.checkpoint import DEFAULT_EAGLE_PATH, load_eagle_head, save_eagle_head
from jaxinfer.speculative.eagle.head import EagleHead, EagleParams, bind_head, head_config, init_eagle_params

__all__ = ["DEFAULT_EAGLE_PATH", "EagleHead", "EagleParams", "bind_head", "head_config", "init_eagle_params",
           "load_eagle_head", "save_eagle_head"]
