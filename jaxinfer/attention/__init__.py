"""Attention: every variant's jnp reference, one dispatch to reference or kernel, RoPE.

    dispatch.py    paged_attention / streaming_attention / mla_attention (..., impl=): the
                   only entry the model calls; picks the reference or a Pallas kernel
    reference.py   the pure-jnp reference of every variant (the kernels are tested against it)
    mesh.py        paged writes + attention per device under shard_map on a mesh
    rope.py        rotary position embeddings
"""

from jaxinfer.attention.dispatch import IMPLS, mla_attention, paged_attention, streaming_attention, target_platform
from jaxinfer.attention.reference import (mla_attention_reference, paged_attention_reference,
                                          streaming_attention_reference)

__all__ = ["IMPLS", "mla_attention", "mla_attention_reference", "paged_attention", "paged_attention_reference",
           "streaming_attention", "streaming_attention_reference", "target_platform"]
