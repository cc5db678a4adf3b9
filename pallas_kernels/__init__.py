"""Pallas kernels for paged and quantized attention (GPU and TPU).

Empty for now: every kernel added here is checked in interpret mode against the pure-`jnp`
reference `jaxinfer.model.attention.paged_attention_reference`. Keep this package
import-light (no jax import at module import time beyond what a kernel needs).
"""
