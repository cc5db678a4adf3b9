"""Every kernel lowers for TPU v5e / v6e (Mosaic TPU) and CUDA sm90 (Triton, and Mosaic GPU) at production shapes.

`pallas_kernels.lowering.matrix(("int4",))`: decode and chunked prefill x every cache format x
(plain; window + sinks + sink logits + soft-cap) x target at 32 query / 8 KV heads, head_dim
128, page 16, batch 8, context 2k; then a sweep of MQA (8 / 1), head_dim 64 / 256, page 64,
batch 64 and 8k contexts over int4 (packed: its channel parts are what a head_dim or page size
can break); and the MLA latent decode kernel (bf16 latent cache, its only format) x target at
DeepSeek-like shapes (r 512 + RoPE 64, 16 and 128 heads, pages 16 and 64, batch 8-64, to 8k).
The Mosaic GPU kernels (decode and chunked prefill, `paged_attention_mgpu`) lower for every
format they take (dense bf16, int8, fp8, KIVI int4 / int2) x options at the base and sweep shapes
where `mgpu_supports` takes them (`lowering.mosaic_matrix`: 100 exports; that export also checks each
program's shared memory against an H100's 227 KiB). `python -m pallas_kernels.lowering` runs
the Triton / TPU sweep over dense and int2 too (BENCHMARKS.md). Each export runs the kernel's whole Python-side lowering (block shapes,
index maps, casts); the fp8 x CUDA rows failed here ("cannot cast ... to f8E4M3FN": a masked
load's int fill) until gpu_tiles.masked_gather filled with the ref's own dtype. About 60 s of
CPU for the 105 exports.
"""

from __future__ import annotations

import pytest

from pallas_kernels import lowering


def _id(case) -> str:
    kernel, target, fmt, shape, with_options = case
    return f"{kernel}-{target}-{fmt}-{shape.label().replace(' ', '_')}-{'options' if with_options else 'plain'}"


@pytest.mark.parametrize("case", lowering.matrix(("int4",)), ids=_id)
def test_kernel_lowers_for_target(case):
    kernel, target, fmt, shape, with_options = case
    module = lowering.lower(kernel, target, fmt, shape, with_options)
    assert module.count(lowering.CUSTOM_CALL[target]) == 1  # the kernel itself, not an XLA fallback; one launch


def test_matrix_covers_the_claim():
    """The table in BENCHMARKS.md counts this matrix: every format, both option sets and every
    target at the base shape, and the sweep reaches MQA, head_dim 64 and 256, page 64, 8k."""
    cases = lowering.matrix(("int4",))
    base = {(k, t, f, o) for k, t, f, s, o in cases if s == lowering.BASE and t != lowering.MOSAIC_GPU}
    assert len(base) == 2 * 3 * 6 * 2  # decode, prefill x TPU v5e, v6e, CUDA (Triton) x formats x options
    mosaic = {(k, f, o) for k, t, f, s, o in cases if s == lowering.BASE and t == lowering.MOSAIC_GPU}
    assert len(mosaic) == 2 * 6 * 2  # decode, prefill x dense, int8, fp8_e4m3, fp8_e5m2, int4, int2 x options
    assert len([c for c in cases if c[1] == lowering.MOSAIC_GPU]) == 100
    mla = [(t, s) for k, t, _, s, _ in cases if k == "mla_decode"]
    assert len(mla) == 3 * len(lowering.MLA_SHAPES)
    assert {s.heads for _, s in mla} == {16, 128} and max(s.context for _, s in mla) == 8192
    shapes = {s for k, _, _, s, _ in cases if k != "mla_decode"}
    assert {s.head_dim for s in shapes} == {64, 128, 256}
    assert {s.page_size for s in shapes} == {16, 64}
    assert (8, 1) in {(s.q_heads, s.kv_heads) for s in shapes}
    assert max(s.context for s in shapes) == 8192 and max(s.batch for s in shapes) == 64


def test_lowering_names_bad_arguments():
    with pytest.raises(ValueError, match="target='tpu_v4'"):
        lowering.lower("decode", "tpu_v4", "dense")
    with pytest.raises(ValueError, match="fmt='int3'"):
        lowering.lower("decode", "cuda_sm90", "int3")
    with pytest.raises(ValueError, match="kernel='verify'"):
        lowering.lower("verify", "cuda_sm90", "dense")
    with pytest.raises(ValueError, match="mla_decode lowers for fmt='dense'"):
        lowering.lower("mla_decode", "cuda_sm90", "int8", lowering.MLA_SHAPES[0])


def test_command_line_filters_the_matrix(capsys):
    assert lowering.main(["--kernel", "mla_decode", "--target", "tpu_v5e"]) == 0
    table = capsys.readouterr().out
    assert f"| mla_decode | tpu_v5e | {len(lowering.MLA_SHAPES)} / {len(lowering.MLA_SHAPES)} | 0 |" in table
    assert "| decode" not in table
    with pytest.raises(SystemExit) as exit_:
        lowering.main(["--help"])
    assert exit_.value.code == 0 and "--kernel" in capsys.readouterr().out


def test_the_dispatch_exports_real_kernels_under_target_platform():
    """A model's attention exported from this CPU for a TPU or GPU holds that device's kernel
    (a Mosaic TPU / Triton custom call) under `target_platform`; without it, the dispatch traced
    here picks the reference ("auto") or the interpreter (a kernel impl), never a kernel call."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from jaxinfer.attention import paged_attention, target_platform
    from jaxinfer.kv.dense import LayerKV

    sds = jax.ShapeDtypeStruct
    args = (sds((2, 1, 8, 64), jnp.bfloat16), LayerKV(sds((9, 16, 2, 64), jnp.bfloat16), sds((9, 16, 2, 64), jnp.bfloat16)),
            sds((2, 4), jnp.int32), sds((2,), jnp.int32), sds((2, 1), jnp.int32))
    tpu = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="TPU v5e", num_cores=1, platform="tpu"))
    triton = [jax.export.DisabledSafetyCheck.custom_call(lowering.CUSTOM_CALL["cuda_sm90"])]

    def export(impl: str, platform: str | None, to: str) -> str:
        """`impl` traced as if for `platform` (None: this CPU's own view), exported for `to`."""
        fn = jax.jit(lambda q, layer, bt, lengths, qi: paged_attention(q, layer, bt, lengths, qi, 0.125, impl=impl))
        with target_platform(platform) if platform else contextlib.nullcontext():
            if to == "cuda":
                return jax.export.export(fn, platforms=["cuda"], disabled_checks=triton)(*args).mlir_module()
            with jax.sharding.use_abstract_mesh(tpu):
                return jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()

    assert "tpu_custom_call" in export("auto", "tpu", "tpu") and "tpu_custom_call" in export("pallas_tpu", "tpu", "tpu")
    assert lowering.CUSTOM_CALL["cuda_sm90"] in export("auto", "gpu", "cuda")
    assert "tpu_custom_call" not in export("pallas_tpu", None, "tpu") + export("auto", None, "tpu")
    assert lowering.CUSTOM_CALL["cuda_sm90"] not in export("pallas_gpu", None, "cuda")  # interpreted: traced on a CPU
    with pytest.raises(ValueError, match="'gpu' or 'tpu'"):
        with target_platform("cuda"):
            pass
