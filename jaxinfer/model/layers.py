"""Small pure building blocks of a Llama-family decoder layer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.attention.rope import apply_rope, rope_inv_freq  # re-exported: RoPE lives with attention

__all__ = ["DEFAULT_READS", "PANEL_MAX_ROWS", "PANEL_WIDTHS", "READS", "LinearLayouts", "apply_rope", "geglu_mlp", "linear", "linears", "panel_matmul", "panel_width",
           "rms_norm", "rope_inv_freq", "swiglu_mlp", "to_panels"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., D], weight: [D]. Statistics in f32 whatever the input dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


PANEL_WIDTHS = (64, 32, 16, 8)  # output columns per panel, widest that divides N first
PANEL_MAX_ROWS = 6  # more rows read `kn` faster (equal at 8, BENCHMARKS.md)
# The layout a product of one row, and of 2 to PANEL_MAX_ROWS rows, may read
# (`LinearLayouts.reads`). Which is fastest depends on the CPU, not only on the shapes
# (BENCHMARKS.md, "Which layout each row count reads"): ("nk", "panels") on the AMD EPYC
# machines, ("kn", "kn") on an AMX-capable Xeon. `jaxinfer.model.row_layouts` measures it.
READS = (("nk", "kn"), ("panels", "kn"))
DEFAULT_READS = ("nk", "panels")


@struct.dataclass
class LinearLayouts:
    """A linear weight kept in the three layouts XLA:CPU's products read fastest, chosen by
    how many rows multiply it (`with_gemm_weights`; BENCHMARKS.md, "Matmul forms"):

    - 1 row (a batch-1 decode step): `reads[0]`, `nk` (`x @ w.T`, which XLA:CPU fuses into
      a loop gemv) or `kn` (a library gemv);
    - 2 to `PANEL_MAX_ROWS` rows (verify blocks at batch 1): `reads[1]`, `panels` (the
      weight cut into column panels of P outputs each laid out [K, P], as one matmul batched
      over panels) or `kn`;
    - more rows (batches, prefill chunks): `kn`.

    From `nk`, XLA:CPU's GEMM re-lays the weight out on every call; each other layout it reads
    as it is. Which is faster depends on the rows (SmolLM2's 30 layers in a chain on an AMD
    EPYC, ms: 3 rows 27 over `kn`, 16 over `panels`; 16 rows 35 over `kn`, 45 over `panels`)
    and on the CPU (on a Xeon, one row reads `kn` 2-3x faster than `nk`'s loop gemv):
    `reads` is static, chosen per machine by `jaxinfer.model.row_layouts`.
    Three times the weight's memory; where one row reads `kn`, the first weight of a group
    that `linears` multiplies together (q with k and v, gate with up) also keeps `group`."""

    nk: jax.Array             # [..., N, K]: the HF layout
    panels: jax.Array | None  # [..., N // P, K, P]: panels[..., j, :, c] = nk[..., j * P + c, :]; None if no P divides N
    kn: jax.Array             # [..., K, N]: nk transposed
    # static: the layout 1 row and 2..PANEL_MAX_ROWS rows read (one of each of `READS`)
    reads: tuple[str, str] = struct.field(pytree_node=False, default=DEFAULT_READS)
    # [..., K, N + N' + ...]: `kn` and the kn of the weights `linears` takes with this one,
    # side by side, so one row reads the group in one gemv: each small product pays a fixed
    # cost (q/k/v and gate/up grouped: a batch-1 step 31.0 -> 29.0 ms on the Xeon, BENCHMARKS.md)
    group: jax.Array | None = None

    @classmethod
    def of(cls, w: jax.Array, reads: tuple[str, str] = DEFAULT_READS) -> LinearLayouts:
        """w: [..., N, K] in all three layouts (`w` itself is `nk`)."""
        check_reads(reads)
        panels = to_panels(w) if panel_width(w.shape[-2]) else None
        return cls(nk=w, panels=panels, kn=jnp.swapaxes(w, -1, -2), reads=tuple(reads))


def check_reads(reads) -> tuple[str, str]:
    """`reads` as a pair, or ValueError naming what each row count may read (`READS`)."""
    if not (isinstance(reads, tuple) and len(reads) == 2 and all(r in ok for r, ok in zip(reads, READS))):
        raise ValueError(f"reads={reads!r}: one row reads one of {READS[0]}, 2-{PANEL_MAX_ROWS} rows one of {READS[1]}")
    return tuple(reads)


def panel_width(n: int) -> int | None:
    """The panel width `to_panels` uses for N outputs: the first of `PANEL_WIDTHS` that divides N."""
    return next((p for p in PANEL_WIDTHS if n % p == 0), None)


def to_panels(w: jax.Array) -> jax.Array:
    """[..., N, K] -> [..., N // P, K, P] with P = `panel_width(N)`."""
    *lead, n, k = w.shape
    p = panel_width(n)
    if p is None:
        raise ValueError(f"no panel width in {PANEL_WIDTHS} divides {n} outputs")
    return jnp.swapaxes(w.reshape(*lead, n // p, p, k), -1, -2)


def panel_matmul(x: jax.Array, panels: jax.Array, preferred_element_type=None) -> jax.Array:
    """x: [..., K], panels: [N // P, K, P] (`to_panels`) -> [..., N]: a matmul batched over
    panels, x broadcast to each (a copy of N // P x rows x K: 8.8 MB for SmolLM2's LM head at
    5 rows; from ~8 rows `LinearLayouts.kn` is faster anyway, so `linear` stops here at
    `PANEL_MAX_ROWS`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    nb, _, p = panels.shape
    rows = x.reshape(1, -1, k)
    y = jax.lax.dot_general(jnp.broadcast_to(rows, (nb, *rows.shape[1:])), panels, (((2,), (1,)), ((0,), (0,))),
                            preferred_element_type=preferred_element_type)  # [N // P, rows, P]
    return jnp.swapaxes(y, 0, 1).reshape(*lead, nb * p)


def linear(x: jax.Array, w: jax.Array | LinearLayouts, b: jax.Array | None = None, *,
           preferred_element_type=None) -> jax.Array:
    """x: [..., K], w: [N, K] (HF layout) -> [..., N].

    A single row (a batch-1 decode step) is written `x @ w.T`: XLA:CPU fuses that transpose
    into its multi-threaded loop gemv, which on the AMD EPYC machines read w at memory speed
    where the einsum (or a dot_general contracting w's last axis) became a plain dot thunk
    20-30 % slower (BENCHMARKS.md, "Decode at the hardware limit"; on a Xeon the library
    gemv is the faster one, see `LinearLayouts`). A weight carrying several layouts is read
    in the one its `reads` names for the number of rows."""
    rows = math.prod(x.shape[:-1])
    if isinstance(w, LinearLayouts):
        layout = "kn" if rows > PANEL_MAX_ROWS else w.reads[0] if rows == 1 else w.reads[1]
        if layout == "panels" and w.panels is not None:
            y = panel_matmul(x, w.panels, preferred_element_type)
        elif layout == "kn" or layout == "panels":
            y = jnp.matmul(x, w.kn, preferred_element_type=preferred_element_type)
        else:
            y = linear(x, w.nk, preferred_element_type=preferred_element_type)
    elif rows == 1:
        y = jnp.matmul(x.reshape(1, -1), w.T, preferred_element_type=preferred_element_type).reshape(*x.shape[:-1], -1)
    else:
        y = jnp.einsum("...k,nk->...n", x, w, preferred_element_type=preferred_element_type)
    return y if b is None else y + b


def linears(x: jax.Array, ws: tuple[jax.Array | LinearLayouts, ...],
            bs: tuple[jax.Array | None, ...] | None = None) -> list[jax.Array]:
    """[linear(x, w, b) for w, b in zip(ws, bs)]. For a single row, one gemv (and one bias add)
    over all the weights: in `nk`, concatenated inside the program (XLA:CPU fuses the
    concatenation into its loop gemv's reads: nothing is copied); in `kn`, the first weight's
    stored `group`. One large read beats several small ones (q, k, v of SmolLM2: 2.9 -> 2.1 ms
    a step). More rows, or a `kn` read without a group, would copy the weights: separate."""
    bs = bs or (None,) * len(ws)
    one_row = math.prod(x.shape[:-1]) == 1
    reads_kn = [isinstance(w, LinearLayouts) and w.reads[0] == "kn" for w in ws]
    grouped = (one_row and all(reads_kn) and ws[0].group is not None
               and ws[0].group.shape[-1] == sum(w.nk.shape[-2] for w in ws))
    if not one_row or (any(reads_kn) and not grouped):
        return [linear(x, w, b) for w, b in zip(ws, bs)]
    nks = [w.nk if isinstance(w, LinearLayouts) else w for w in ws]
    b = None if all(b is None for b in bs) else jnp.concatenate(
        [jnp.zeros(w.shape[-2], w.dtype) if b is None else b for w, b in zip(nks, bs)])
    if grouped:
        y = jnp.matmul(x.reshape(1, -1), ws[0].group).reshape(*x.shape[:-1], -1)
        y = y if b is None else y + b
    else:
        y = linear(x, jnp.concatenate(nks), b)
    return jnp.split(y, np.cumsum([w.shape[-2] for w in nks[:-1]]), axis=-1)


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)); x: [..., D] -> [..., D]."""
    gate, up = linears(x, (w_gate, w_up))
    return linear(jax.nn.silu(gate) * up, w_down)


def geglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma's `gelu_pytorch_tanh`); x: [..., D] -> [..., D]."""
    gate, up = linears(x, (w_gate, w_up))
    return linear(jax.nn.gelu(gate, approximate=True) * up, w_down)
