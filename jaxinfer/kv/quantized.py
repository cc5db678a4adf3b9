"""Moved: the quantized cache formats live in `jaxinfer.kv.token_quant` (int8, fp8) and
`jaxinfer.kv.kivi` (int4, int2); `make_layer_kv` and `one_shot_round_trip` in
`jaxinfer.kv.layer_cache`. These re-exports are kept for one release."""

from jaxinfer.kv.kivi import KiviLayerKV
from jaxinfer.kv.layer_cache import make_layer_kv, one_shot_round_trip
from jaxinfer.kv.token_quant import TokenQuantLayerKV

__all__ = ["KiviLayerKV", "TokenQuantLayerKV", "make_layer_kv", "one_shot_round_trip"]
