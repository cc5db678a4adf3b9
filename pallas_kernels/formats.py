"""K/V page formats as the kernels read them, and the kernels' in-tile dequantization.

The storage layouts are defined once, in `jaxinfer.kv.formats` (quantize / dequantize math)
and `jaxinfer.kv.dense` / `token_quant` / `kivi` (the cache pytrees); `KernelPages` is a view of one layer's
arrays in that layout (no copy) that the kernels block and dequantize tile by tile, never
materialising a dequantized cache::

    format          k, v (stored)                scales, zeros (bf16)               value
    dense           [P, S, H, D] f32/bf16        -                                  x
    int8            [P, S, H, D] i8              k_scale, v_scale [P, S, H]         x * s
    fp8_e4m3/e5m2   [P, S, H, D] f8              k_scale, v_scale [P, S, H]         f32(x) * s
    int4 / int2     [P, S, H, D*bits/8] u8       k_scale, k_zero [P, H, D] (KIVI    z + code * s
                    (8/bits channel *parts*:     keys: per channel over a page)
                    byte j holds code j of       v_scale, v_zero [P, S, H] (KIVI
                    every part)                  values: per token)
                    k_tail, v_tail [M, S, H, D]: the page being filled, full precision,
                    read instead of logical page `length // S` of the slot's sequence

The kernels work on channel *parts*: a packed format's K tile splits into 8/bits tiles of
D*bits/8 channels (part i = (byte >> i*bits) & mask), the query into the matching channel
slices, and scores add up over parts; values and outputs split the same way. Unpacked
formats have one part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.kv import formats as F
from jaxinfer.kv.dense import LayerKV
from jaxinfer.kv.kivi import KiviLayerKV
from jaxinfer.kv.token_quant import TokenQuantLayerKV

KERNEL_FORMATS = ("dense", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")


@struct.dataclass
class KernelPages:
    """One layer's K/V storage in one format (shapes in the module docstring)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    k_zero: jax.Array | None = None  # KIVI only
    v_zero: jax.Array | None = None  # KIVI only
    k_tail: jax.Array | None = None  # KIVI only: [max_slots, S, H, D]
    v_tail: jax.Array | None = None
    format: str = struct.field(pytree_node=False, default="dense")

    def __post_init__(self) -> None:
        if self.format not in KERNEL_FORMATS:
            raise ValueError(f"format={self.format!r} must be one of {KERNEL_FORMATS}")

    @property
    def is_kivi(self) -> bool:
        return self.format in ("int4", "int2")

    def row_slots(self, slots: jax.Array | None, batch: int) -> jax.Array:
        """i32[B]: each row's cache slot. KIVI pages keep each slot's current page in a tail,
        which the engine's rows do not find by their index: the caller names the slots.
        Other formats read no tail (None: rows 0..B-1)."""
        if slots is not None:
            return slots
        if self.k_tail is not None:
            raise ValueError(f"the {self.format!r} pages keep each slot's current page in a tail: pass slots= "
                             "(i32[B]: each row's cache slot)")
        return jnp.arange(batch, dtype=jnp.int32)

    @property
    def bits(self) -> int:
        return F.get_format(self.format).bits if self.is_kivi else 0

    @property
    def parts(self) -> int:
        """Channel parts the kernels split D into (8 / bits for packed formats, else 1)."""
        return 8 // self.bits if self.is_kivi else 1

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3] * self.parts

    def k_parts(self) -> tuple[jax.Array, ...]:
        """The stored arrays that make up K: values, then scale and zero where the format has them."""
        return tuple(a for a in (self.k, self.k_scale, self.k_zero) if a is not None)

    def v_parts(self) -> tuple[jax.Array, ...]:
        return tuple(a for a in (self.v, self.v_scale, self.v_zero) if a is not None)

    def part_layouts(self, which: str) -> tuple[str, ...]:
        """Per stored array: "token" (leading [P, S, H]) or "channel" ([P, H, D]: KIVI key scales)."""
        n = len(self.k_parts() if which == "k" else self.v_parts())
        return ("token",) + (("channel",) if self.is_kivi and which == "k" else ("token",)) * (n - 1)

    def validate(self) -> None:
        """Trace-time shape and dtype checks; raises ValueError naming the bad array."""
        p, s, h, _ = self.k.shape
        d = self.head_dim
        if self.v.shape != self.k.shape:
            raise ValueError(f"v shape {self.v.shape} != k shape {self.k.shape}")
        if self.format == "dense":
            if not jnp.issubdtype(self.k.dtype, jnp.floating) or jnp.dtype(self.k.dtype).itemsize < 2:
                raise ValueError(f"dense pages must be f32/bf16/f16, got {self.k.dtype}")
            return
        stored = jnp.dtype(F.get_format(self.format).storage_dtype)
        if self.k.dtype != stored or self.v.dtype != stored:
            raise ValueError(f"{self.format} pages must be {stored.name}, got {self.k.dtype}/{self.v.dtype}")
        token = (p, s, h)
        expect = [("k_scale", self.k_scale, token), ("v_scale", self.v_scale, token)]
        if self.is_kivi:
            expect = [("k_scale", self.k_scale, (p, h, d)), ("k_zero", self.k_zero, (p, h, d)),
                      ("v_scale", self.v_scale, token), ("v_zero", self.v_zero, token)]
            tail = self.k_tail.shape if self.k_tail is not None else None
            expect += [("k_tail", self.k_tail, (tail or (0,))[:1] + (s, h, d)),
                       ("v_tail", self.v_tail, (tail or (0,))[:1] + (s, h, d))]
        for name, a, shape in expect:
            if a is None or tuple(a.shape) != tuple(shape):
                raise ValueError(f"{self.format}: {name} must have shape {shape}, got {None if a is None else a.shape}")


def from_layer_kv(layer) -> KernelPages:
    """A jaxinfer layer cache (`LayerKV`, `TokenQuantLayerKV`, `KiviLayerKV`) as `KernelPages` (no copy)."""
    if isinstance(layer, LayerKV):
        return KernelPages(k=layer.k, v=layer.v)
    if isinstance(layer, TokenQuantLayerKV):
        return KernelPages(k=layer.k_q, v=layer.v_q, k_scale=layer.k_scale, v_scale=layer.v_scale, format=layer.format)
    if isinstance(layer, KiviLayerKV):
        return KernelPages(k=layer.k_q, v=layer.v_q, k_scale=layer.k_scale, v_scale=layer.v_scale,
                           k_zero=layer.k_zero, v_zero=layer.v_zero, k_tail=layer.k_tail, v_tail=layer.v_tail,
                           format=layer.format)
    raise ValueError(f"no Pallas attention kernel reads a {type(layer).__name__} cache")


def dequantize_part(fmt: str, stored: jax.Array, part: int, scale=None, zero=None) -> jax.Array:
    """Stored values of a tile -> channel part `part` of it, in f32 (dense: unchanged dtype).

    `scale` / `zero` must broadcast against the part's values (the callers add the axes their
    layout needs). This is the only dequantization the kernels do; it is
    `jaxinfer.kv.formats`' dequantize math, one tile at a time.
    """
    if fmt == "dense":
        return stored
    if fmt in ("int4", "int2"):
        bits = F.get_format(fmt).bits
        codes = (stored >> (part * bits)) & (2**bits - 1)
        return zero.astype(jnp.float32) + codes.astype(jnp.float32) * scale.astype(jnp.float32)
    return stored.astype(jnp.float32) * scale.astype(jnp.float32)
