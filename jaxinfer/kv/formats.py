"""KV-cache storage formats: names, byte accounting, and the quantize / dequantize math.

This module is the single definition of every cache format; the cache pytrees
(`jaxinfer.kv.layer_cache`) and the fused Pallas kernels both import it. It depends on
nothing but jax and numpy.

Storage layout, per layer (P = num_pages, S = page_size, H = n_kv_heads, D = head_dim,
M = max_slots; "compute" = the model's activation dtype)::

    name        pages (K and V alike)            scales                         dequantized value
    ----------  -------------------------------  -----------------------------  --------------------------
    "f32"       k, v: f32[P, S, H, D]            -                              k
    "bf16"      k, v: bf16[P, S, H, D]           -                              k
    "int8"      k_q, v_q: i8[P, S, H, D]         k_scale, v_scale: bf16[P, S, H]  q * scale[..., None]
    "fp8_e4m3"  k_q, v_q: f8_e4m3fn[P, S, H, D]  k_scale, v_scale: bf16[P, S, H]  f32(q) * scale[..., None]
    "fp8_e5m2"  k_q, v_q: f8_e5m2[P, S, H, D]    k_scale, v_scale: bf16[P, S, H]  f32(q) * scale[..., None]
    "int4"      k_q, v_q: u8[P, S, H, D/2]       k_scale, k_zero: bf16[P, H, D]   zero + code * scale
                                                 v_scale, v_zero: bf16[P, S, H]
                k_tail, v_tail: compute[M, S, H, D]   (the page being filled, full precision)
    "int2"      k_q, v_q: u8[P, S, H, D/4]       as int4                        zero + code * scale

int8 and fp8 scale each token of each KV head by its own absmax (symmetric, no zero-point);
they quantize every token as it is written. int4 / int2 follow KIVI: keys are quantized per
channel over the S tokens of a page, values per token, both asymmetric (code in
[0, 2**bits - 1]). A page is quantized when it becomes full; until then its tokens live in
full precision in the slot's tail row (`k_tail[slot, offset]`), and attention reads the
slot's current logical page (`lengths // S`) from the tail instead of from its pages.

Packing (int4, int2): the D codes of a token are split into 8 / bits contiguous parts of
D * bits / 8 codes each; byte j holds code j of part i in bits [i * bits, (i + 1) * bits)::

    int4: byte[j] = c[j] | c[j + D/2] << 4
    int2: byte[j] = c[j] | c[j + D/4] << 2 | c[j + D/2] << 4 | c[j + 3D/4] << 6

so unpacking is shifts and masks followed by a concatenation along D (no interleave).

Scales and zero-points are bf16, rounded *outward* (scales up, zero-points down), so
every value lies inside the representable range and the round-trip error is bounded by
half a quantization step of the *stored* scale: |x - dequant(quant(x))| <= scale / 2 for
the integer formats; for fp8, half a unit in the last place of the fp8 value times the scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCALE_DTYPE = jnp.bfloat16  # dtype of every stored scale and zero-point


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """Static description of one storage format (no arrays)."""

    name: str
    kind: str  # "dense" | "int8" | "fp8" | "kivi"
    bits: int  # bits per stored K or V element
    storage_dtype: str  # numpy dtype name of the page arrays

    @property
    def is_quantized(self) -> bool:
        return self.kind != "dense"

    @property
    def has_tail(self) -> bool:
        """KIVI formats keep the page being filled in a full-precision per-slot tail."""
        return self.kind == "kivi"

    def bytes_per_token(self, n_kv_heads: int, head_dim: int, page_size: int) -> float:
        """Bytes one cached token takes in one layer, K and V, scales and zero-points included."""
        data = n_kv_heads * head_dim * self.bits / 8
        s = jnp.dtype(SCALE_DTYPE).itemsize
        if self.kind in ("int8", "fp8"):
            scales = n_kv_heads * s  # one scale per token per head
            return 2 * (data + scales)
        if self.kind == "kivi":
            k_scales = 2 * n_kv_heads * head_dim * s / page_size  # scale + zero per channel per page
            v_scales = 2 * n_kv_heads * s  # scale + zero per token per head
            return 2 * data + k_scales + v_scales
        return 2 * data

    def slot_overhead_bytes(self, n_kv_heads: int, head_dim: int, page_size: int, compute_dtype) -> int:
        """Bytes per sequence slot and layer outside the pages (the KIVI full-precision tail)."""
        if not self.has_tail:
            return 0
        return 2 * page_size * n_kv_heads * head_dim * jnp.dtype(compute_dtype).itemsize


FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("f32", "dense", 32, "float32"),
        KVFormat("bf16", "dense", 16, "bfloat16"),
        KVFormat("int8", "int8", 8, "int8"),
        KVFormat("fp8_e4m3", "fp8", 8, "float8_e4m3fn"),
        KVFormat("fp8_e5m2", "fp8", 8, "float8_e5m2"),
        KVFormat("int4", "kivi", 4, "uint8"),
        KVFormat("int2", "kivi", 2, "uint8"),
    )
}
FORMAT_NAMES = tuple(FORMATS)
QUANTIZED_FORMATS = tuple(n for n, f in FORMATS.items() if f.is_quantized)
DENSE_FORMAT_OF_DTYPE = {"float32": "f32", "bfloat16": "bf16"}


def get_format(name: str) -> KVFormat:
    """The format called `name`; ValueError listing the valid names otherwise."""
    if not isinstance(name, str) or name not in FORMATS:
        raise ValueError(f"unknown KV-cache format {name!r}; valid formats: {', '.join(FORMAT_NAMES)}")
    return FORMATS[name]


# ---- outward rounding of scales to bf16 ---------------------------------------------------


def round_up_scale(x: jax.Array) -> jax.Array:
    """f32 -> the smallest bf16 >= x."""
    y = x.astype(SCALE_DTYPE)
    return jnp.where(y.astype(jnp.float32) < x, jnp.nextafter(y, jnp.array(jnp.inf, SCALE_DTYPE)), y)


def round_down_scale(x: jax.Array) -> jax.Array:
    """f32 -> the largest bf16 <= x."""
    y = x.astype(SCALE_DTYPE)
    return jnp.where(y.astype(jnp.float32) > x, jnp.nextafter(y, jnp.array(-jnp.inf, SCALE_DTYPE)), y)


def _safe_divide(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / scale, with a zero scale (an all-zero group) giving code 0."""
    return x / jnp.where(scale == 0, 1.0, scale)


# ---- int8: symmetric, one scale per token per head ------------------------------------------


INT8_MAX = 127


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [..., D] -> (i8[..., D], bf16[...]) with x ~= q * scale; |error| <= scale / 2."""
    x = x.astype(jnp.float32)
    scale = round_up_scale(jnp.max(jnp.abs(x), axis=-1) / INT8_MAX)
    q = jnp.round(_safe_divide(x, scale.astype(jnp.float32)[..., None]))
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def dequantize_int8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


# ---- fp8: one scale per token per head, absmax mapped to the fp8 maximum -----------------------


def fp8_dtype(name: str) -> jnp.dtype:
    return jnp.dtype(FORMATS[name].storage_dtype)


def quantize_fp8(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x: [..., D] -> (fp8[..., D], bf16[...]) with x ~= f32(q) * scale.

    |error| <= scale * max(|x / scale| * 2**-(m + 1), smallest_subnormal / 2), m = mantissa bits.
    """
    x = x.astype(jnp.float32)
    fmax = float(jnp.finfo(dtype).max)
    scale = round_up_scale(jnp.max(jnp.abs(x), axis=-1) / fmax)
    y = jnp.clip(_safe_divide(x, scale.astype(jnp.float32)[..., None]), -fmax, fmax)  # e4m3fn has no inf
    return y.astype(dtype), scale


def dequantize_fp8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


# ---- asymmetric low-bit codes (KIVI) ---------------------------------------------------------


def quantize_asym(x: jax.Array, bits: int, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Codes in [0, 2**bits - 1] over groups reduced along `axis` -> (u8 codes, scale, zero).

    x ~= zero + code * scale with zero <= min and zero + (2**bits - 1) * scale >= max,
    so |error| <= scale / 2. scale and zero have `axis` removed.
    """
    x = x.astype(jnp.float32)
    levels = 2**bits - 1
    zero = round_down_scale(jnp.min(x, axis=axis))
    z = jnp.expand_dims(zero.astype(jnp.float32), axis)
    scale = round_up_scale((jnp.max(x, axis=axis) - zero.astype(jnp.float32)) / levels)
    codes = jnp.round(_safe_divide(x - z, jnp.expand_dims(scale.astype(jnp.float32), axis)))
    return jnp.clip(codes, 0, levels).astype(jnp.uint8), scale, zero


def dequantize_asym(codes: jax.Array, scale: jax.Array, zero: jax.Array, axis: int, dtype=jnp.float32) -> jax.Array:
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    z = jnp.expand_dims(zero.astype(jnp.float32), axis)
    return (z + codes.astype(jnp.float32) * s).astype(dtype)


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """u8[..., D] codes of `bits` bits -> u8[..., D * bits / 8] (layout in the module docstring)."""
    parts = 8 // bits
    d = codes.shape[-1]
    if d % parts:
        raise ValueError(f"head_dim={d} must be a multiple of {parts} to pack {bits}-bit codes")
    chunks = jnp.split(codes.astype(jnp.uint8), parts, axis=-1)
    packed = chunks[0]
    for i, c in enumerate(chunks[1:], start=1):
        packed = packed | (c << (i * bits))
    return packed


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_codes`: u8[..., D * bits / 8] -> u8[..., D]."""
    mask = jnp.uint8(2**bits - 1)
    return jnp.concatenate([(packed >> (i * bits)) & mask for i in range(8 // bits)], axis=-1)


def quantize_kivi_keys(k: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Full pages k: [..., S, H, D] -> (packed u8[..., S, H, D*bits/8], scale, zero: bf16[..., H, D])."""
    codes, scale, zero = quantize_asym(k, bits, axis=-3)
    return pack_codes(codes, bits), scale, zero


def dequantize_kivi_keys(packed: jax.Array, scale: jax.Array, zero: jax.Array, bits: int, dtype=jnp.float32) -> jax.Array:
    return dequantize_asym(unpack_codes(packed, bits), scale, zero, axis=-3, dtype=dtype)


def quantize_kivi_values(v: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """v: [..., D] -> (packed u8[..., D*bits/8], scale, zero: bf16[...]), one group per token per head."""
    codes, scale, zero = quantize_asym(v, bits, axis=-1)
    return pack_codes(codes, bits), scale, zero


def dequantize_kivi_values(packed: jax.Array, scale: jax.Array, zero: jax.Array, bits: int, dtype=jnp.float32) -> jax.Array:
    return dequantize_asym(unpack_codes(packed, bits), scale, zero, axis=-1, dtype=dtype)


# ---- round trips (what a format does to values), used by calibration and tests --------------


def round_trip_tokens(name: str, x: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Per-token formats: x: [..., D] -> dequantize(quantize(x)) as the cache would return it."""
    f = get_format(name)
    if f.kind == "dense":
        return x.astype(f.storage_dtype).astype(dtype)
    if f.kind == "int8":
        return dequantize_int8(*quantize_int8(x), dtype=dtype)
    if f.kind == "fp8":
        return dequantize_fp8(*quantize_fp8(x, fp8_dtype(name)), dtype=dtype)
    raise ValueError(f"{name!r} is not a per-token format")


def round_trip_pages(name: str, k: jax.Array, v: jax.Array, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """k, v: [..., S, H, D] (full pages) -> what the cache returns for them once quantized."""
    f = get_format(name)
    if f.kind != "kivi":
        return round_trip_tokens(name, k, dtype), round_trip_tokens(name, v, dtype)
    kq = dequantize_kivi_keys(*quantize_kivi_keys(k, f.bits), f.bits, dtype)
    vq = dequantize_kivi_values(*quantize_kivi_values(v, f.bits), f.bits, dtype)
    return kq, vq

