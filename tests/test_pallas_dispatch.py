"""attention_impl dispatch, and a tiny model end to end with the kernels (interpret mode) vs the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kv import KVCacheSpec, block_table_array, init_paged_kv
from jaxinfer.kv.dense import LayerKV
from jaxinfer.model import forward
from jaxinfer.attention import dispatch
from tiny_models import random_tokens, tiny_model

SPEC = KVCacheSpec(num_pages=16, page_size=4, max_slots=2, max_pages_per_seq=4)
PAGES = [[9, 2, 14, 5], [3, 11, 7, 12]]  # scattered on purpose


def test_resolve_impl_on_cpu():
    q, layer = jnp.zeros((1, 1, 4, 16)), LayerKV(jnp.zeros((3, 4, 2, 16)), jnp.zeros((3, 4, 2, 16)))
    assert jax.default_backend() == "cpu"
    assert dispatch.resolve_impl("auto", q, layer) == (None, False)  # CPU: the reference
    assert dispatch.resolve_impl("reference", q, layer) == (None, False)
    assert dispatch.resolve_impl("pallas", q, layer) == ("gpu", True)  # GPU-style kernels, interpreted
    assert dispatch.resolve_impl("pallas_tpu", q, layer) == ("tpu", True)
    with pytest.raises(ValueError, match="attention_impl='triton'"):
        dispatch.resolve_impl("triton", q, layer)
    with pytest.raises(ValueError, match="no Pallas attention kernel reads a object cache"):
        dispatch.resolve_impl("pallas", q, object())
    with pytest.raises(ValueError, match="target='cuda' must be 'gpu' or 'tpu'"):
        dispatch.unsupported_reason(q, layer, "cuda", interpret=False)


def test_compiled_gpu_kernels_refuse_shapes_triton_cannot_take():
    """auto falls back to the reference for them; pallas says why."""
    layer = LayerKV(jnp.zeros((3, 4, 2, 8)), jnp.zeros((3, 4, 2, 8)))  # head_dim 8 < 16
    assert "head_dim" in dispatch.unsupported_reason(jnp.zeros((1, 1, 4, 8)), layer, "gpu", interpret=False)
    assert dispatch.unsupported_reason(jnp.zeros((1, 1, 4, 8)), layer, "gpu", interpret=True) is None


def _greedy(config, params, impl: str, kv_cache: str, steps: int = 6):
    """Prefill two prompts (7 and 4 tokens: a page multiple), then greedy-decode `steps` tokens."""
    kv = init_paged_kv(config, SPEC, kv_cache=kv_cache)
    kv = kv.replace(block_tables=jnp.asarray(block_table_array(PAGES, SPEC.max_pages_per_seq)))
    prompt_len = jnp.array([7, 4], jnp.int32)
    tokens = jnp.asarray(random_tokens((2, 7), config.vocab_size, seed=3))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    logits, kv = forward(params, config, tokens, pos, kv, num_new=prompt_len, logits_index=prompt_len - 1,
                         attention_impl=impl)
    out, all_logits = [jnp.argmax(logits, -1)], [logits]
    for step in range(steps):
        logits, kv = forward(params, config, out[-1][:, None], (prompt_len + step)[:, None], kv,
                             logits_index=jnp.zeros(2, jnp.int32), attention_impl=impl)
        out.append(jnp.argmax(logits, -1))
        all_logits.append(logits)
    return np.stack(out, 1), np.stack(all_logits, 1)


@pytest.mark.parametrize("kv_cache", ["auto", "int4"])
def test_tiny_model_greedy_tokens_equal_with_pallas(kv_cache):
    """f32 tiny model (GQA 4/2): prefill (chunk kernel) + 6 decode steps (decode kernel) crossing
    pages; "int4" is the KIVI cache, whose current page the kernels read from the slot's tail."""
    config, params = tiny_model(head_dim=16)
    ref_tokens, ref_logits = _greedy(config, params, "reference", kv_cache)
    tokens, logits = _greedy(config, params, "pallas", kv_cache)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("script,first_line,keys", [
    ("kernels_gpu.py", "no GPU", ["copy_gbps", "bf16_frac_of_copy", "int8_frac_of_copy", "int8_speedup_over_bf16",
                                  "int4_speedup_over_bf16", "pallas_over_xla_bf16", "mosaic_over_triton_bf16",
                                  "prefill_tflops_bf16", "mosaic_over_triton_prefill_bf16"]),
    ("engine_gpu.py", "no GPU or TPU", ["device", "reference_tok_s", "auto_tok_s", "auto_int8_tok_s",
                                        "auto_async_tok_s", "auto_over_reference", "int8_over_bf16",
                                        "async_over_sync", "host_ms_per_step", "device_idle_frac",
                                        "steady_state_compiles",
                                        "first_token_match_frac", "greedy_match_frac", "fallbacks"]),
])
def test_gpu_benchmarks_without_a_gpu_say_so_and_print_nulls(script, first_line, keys):
    path = Path(__file__).parent.parent / "benchmarks" / script
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert first_line in lines[0]
    summary = json.loads(lines[-1])
    assert list(summary) == keys
    assert all(v is None for v in summary.values())


@pytest.mark.extended
def test_kernels_gpu_benchmark_runs_its_rows_in_interpret_mode():
    """kernels_gpu.py's code path on this CPU (kernels in interpret mode, tiny shapes): decode
    and prefill rows of both GPU families, and every summary key filled (figures meaningless)."""
    script = Path(__file__).parent.parent / "benchmarks" / "kernels_gpu.py"
    run = subprocess.run([sys.executable, str(script), "--interpret-smoke", "--skip-checks", "--formats", "bf16"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if "kernel_ms=" in line]
    assert {(("prefill" if line.startswith("kernel=prefill") else "decode"), line.split("kernels=")[1].split()[0])
            for line in rows} == {(k, f) for k in ("decode", "prefill") for f in ("triton", "mosaic")}
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    filled = {"copy_gbps", "bf16_frac_of_copy", "pallas_over_xla_bf16", "mosaic_over_triton_bf16",
              "prefill_tflops_bf16", "mosaic_over_triton_prefill_bf16"}
    assert all(summary[k] is not None and summary[k] > 0 for k in filled), summary


@pytest.mark.extended
def test_engine_gpu_benchmark_measures_each_config_on_a_tiny_model():
    """The benchmark's measuring function on a tiny model here: every config decodes, the
    steady state compiles nothing, no kernel falls back (CPU: "auto" is the reference)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import engine_gpu
    from jaxinfer.loading import Model

    config, params = tiny_model()
    ids = random_tokens((3, 12), config.vocab_size).tolist()
    tokens = {}
    for name, engine_args in engine_gpu.CONFIGS.items():
        result = engine_gpu.run_config(Model(config, params, None), ids, 6, **engine_args)
        assert result["tok_s"] > 0 and result["steady_state_compiles"] == 0 and result["fallbacks"] == []
        assert (result["host_ms"] is None) == (name == "auto_async")
        tokens[name] = result["tokens"]
        assert [len(t) for t in tokens[name]] == [6, 6, 6]
    assert tokens["auto"] == tokens["reference"] == tokens["auto_async"]


def test_engine_gives_the_same_greedy_tokens_with_the_kernels():
    """The serving engine (chunked prefill + decode groups) with attention_impl="pallas" in
    interpret mode, against the reference path."""
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.loading import Model
    from jaxinfer.sampling import SamplingParams
    from tiny_models import tiny_model

    config, params = tiny_model(n_heads=4, n_kv_heads=2, head_dim=16)
    model = Model(config=config, params=params, tokenizer=None)
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [26, 43, 38]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for impl in ("reference", "pallas"):
        cfg = EngineConfig(max_slots=2, page_size=4, prefill_chunk=4, max_model_len=32, attention_impl=impl)
        outs[impl] = [o.token_ids for o in Engine(model, cfg).generate(prompts, sp)]
    assert outs["pallas"] == outs["reference"]


def _mla_config():
    from jaxinfer.config import MLAConfig
    from tiny_models import tiny_config

    mla = MLAConfig(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4, v_head_dim=6, q_lora_rank=24)
    return tiny_config(arch="deepseek_v3", n_heads=4, n_kv_heads=4, head_dim=12, mla=mla)


def test_streaming_goes_through_the_dispatch():
    """The StreamingLLM ring has no kernel: a kernel impl says so (it used to be ignored
    silently), "auto" and "reference" give the same logits."""
    from jaxinfer.kv import StreamingSpec
    from jaxinfer.model import init_random_params

    config = tiny_model()[0]
    params = init_random_params(config, seed=0, scale=0.3)
    spec = KVCacheSpec(num_pages=9, page_size=4, max_slots=2, max_pages_per_seq=4)

    def run(impl):
        kv = init_paged_kv(config, spec, streaming=StreamingSpec(num_sinks=2, window=6))
        kv = kv.replace(block_tables=jnp.asarray(block_table_array([[1, 2, 3, 4], [5, 6, 7, 8]], 4)))
        tokens = jnp.asarray(random_tokens((2, 5), config.vocab_size, seed=1))
        logits, _ = forward(params, config, tokens, jnp.broadcast_to(jnp.arange(5), (2, 5)), kv, attention_impl=impl)
        return np.asarray(logits)

    for impl in ("pallas", "pallas_gpu", "pallas_tpu"):
        with pytest.raises(ValueError, match=f"attention_impl='{impl}': no Pallas kernel implements StreamingLLM"):
            run(impl)
    np.testing.assert_array_equal(run("auto"), run("reference"))
    with pytest.raises(ValueError, match="must be one of"):
        run("triton")


def test_mla_decode_runs_the_kernel_prefill_the_reference(monkeypatch):
    """An MLA model: prefill (5 tokens, expanded form) is the reference's under every impl; a
    decode step (absorbed) runs the MLA kernel of the impl's target, in interpret mode here,
    and matches the reference's logits to f32 summation order; "auto" on CPU is the reference."""
    from jaxinfer.model import init_random_params

    config = _mla_config()
    params = init_random_params(config, seed=0, scale=0.3)
    spec = KVCacheSpec(num_pages=9, page_size=4, max_slots=2, max_pages_per_seq=4)
    called = []
    real_kernel = dispatch._kernel
    monkeypatch.setattr(dispatch, "_kernel", lambda target, kind: called.append((target, kind)) or
                        real_kernel(target, kind))

    def run(impl):
        kv = init_paged_kv(config, spec)
        kv = kv.replace(block_tables=jnp.asarray(block_table_array([[1, 2, 3, 4], [5, 6, 7, 8]], 4)))
        tokens = jnp.asarray(random_tokens((2, 6), config.vocab_size, seed=1))
        prefill, kv = forward(params, config, tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), kv,
                              attention_impl=impl)
        decode, _ = forward(params, config, tokens[:, 5:], jnp.full((2, 1), 5), kv, attention_impl=impl)
        return np.asarray(prefill), np.asarray(decode)

    want = run("reference")
    assert called == []
    np.testing.assert_array_equal(run("auto")[1], want[1])
    for impl, target in (("pallas", "gpu"), ("pallas_gpu", "gpu"), ("pallas_tpu", "tpu")):
        prefill, decode = run(impl)
        assert called[-1] == (target, "mla_decode")
        np.testing.assert_array_equal(prefill, want[0])
        np.testing.assert_allclose(decode, want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.extended  # tests/test_pallas_mla.py checks the MLA kernel against the reference
def test_engine_mla_kernel_tokens_match_the_reference():
    """An MLA tiny model served with the GPU-style and the TPU-style MLA decode kernel
    (interpret mode) greedy-decodes the reference's tokens."""
    from jaxinfer.loading import Model
    from jaxinfer.model import init_random_params

    mla = _mla_config()
    model = Model(mla, init_random_params(mla, seed=0, scale=0.3), None)
    want = _engine_tokens(model, "reference")[0]
    for impl in ("pallas", "pallas_tpu"):
        assert _engine_tokens(model, impl)[0] == want, impl


def test_engine_refuses_a_kernel_impl_for_streaming_up_front():
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.loading import Model

    config, params = tiny_model()
    with pytest.raises(ValueError, match="no Pallas kernel implements StreamingLLM ring attention"):
        Engine(Model(config, params, None), EngineConfig(max_slots=2, streaming=(2, 6), attention_impl="pallas"))


def _engine(model, impl: str | None = None):
    """An engine for two short prompts; `impl` None: EngineConfig's default attention_impl."""
    from jaxinfer.engine import Engine, EngineConfig

    extra = {} if impl is None else dict(attention_impl=impl)
    return Engine(model, EngineConfig(max_slots=2, page_size=4, prefill_chunk=4, max_model_len=32, **extra))


def _generate(engine) -> list[list[int]]:
    """Greedy tokens of two prompts (10 and 3 tokens: chunked prefill, then decode)."""
    from jaxinfer.sampling import SamplingParams

    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [26, 43, 38]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    return [o.token_ids for o in outs]


def _engine_tokens(model, impl: str | None = None):
    engine = _engine(model, impl)
    return _generate(engine), engine


def _tiny_engine_model():
    from jaxinfer.loading import Model

    config, params = tiny_model(n_heads=4, n_kv_heads=2, head_dim=16)
    return Model(config=config, params=params, tokenizer=None)


def test_auto_is_the_default_and_cpu_runs_the_reference(caplog):
    from jaxinfer.engine import EngineConfig

    assert EngineConfig().attention_impl == "auto"
    model = _tiny_engine_model()
    tokens, engine = _engine_tokens(model)
    assert tokens == _engine_tokens(model, "reference")[0]
    assert engine.fallbacks == {} and not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.fixture
def fake_gpu(monkeypatch):
    """The dispatch believes it runs on a GPU; jit caches are cleared on the way in and out
    (a program's key holds the impl, "auto", not the backend it resolved to)."""
    jax.clear_caches()
    monkeypatch.setattr(dispatch, "backend", lambda: "gpu")
    yield
    monkeypatch.undo()
    jax.clear_caches()


def test_kernels_that_fail_to_compile_fall_back_with_one_warning(fake_gpu, caplog):
    """On a (faked) GPU "auto" compiles the Triton kernels, which cannot compile on this CPU
    ("Only interpret mode is supported"): warm-up falls every program back to the reference
    and serving compiles nothing more; the tokens are the reference's, and one warning names
    the kernel."""
    model = _tiny_engine_model()
    want = _engine_tokens(model, "reference")[0]
    engine = _engine(model)
    engine.warmup()
    assert set(engine.fallbacks) == set(engine.program_keys())
    compiled = engine.metrics().obtained_programs
    assert _generate(engine) == want
    assert engine.metrics().obtained_programs == compiled
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("attention kernel paged_decode_gpu failed to compile on ")
    assert "Only interpret mode is supported" in warnings[0]


def test_only_programs_of_the_failing_kernel_fall_back(fake_gpu, monkeypatch, caplog):
    """The decode kernel works (interpret mode stands in for the device), the chunked-prefill
    kernel is made to fail: programs with a prefill group run the reference, decode-only
    programs keep the kernel, the tokens match the reference, one warning names the kernel."""
    model = _tiny_engine_model()
    want = _engine_tokens(model, "reference")[0]
    real_kernel = dispatch._kernel

    def kernel(target, kind):
        if kind == "prefill":
            raise RuntimeError("planted: chunked_prefill_gpu does not compile here")
        fn = real_kernel(target, kind)
        return lambda *args, **kw: fn(*args, **{**kw, "interpret": True})

    monkeypatch.setattr(dispatch, "_kernel", kernel)
    tokens, engine = _engine_tokens(model)
    assert tokens == want
    with_prefill = {key for key in engine._ran if key[1]}
    assert with_prefill and set(engine.fallbacks) == with_prefill
    assert set(engine.fallbacks.values()) == {"chunked_prefill_gpu"}
    assert all(engine.attention_impl(key) == "auto" for key in engine._ran - with_prefill)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "attention kernel chunked_prefill_gpu failed to compile" in warnings[0], warnings


def test_gpu_kernel_family_mosaic_prefill_on_hopper_triton_elsewhere(monkeypatch):
    """On a Hopper GPU the Mosaic GPU prefill kernel takes bf16/f16, int8 and fp8 pages whose tiles
    fit; decode (Triton measured 1.8x faster on an H200), f32 and KIVI pages (the Mosaic GPU
    kernel reads them, unverified on a device), any pre-Hopper GPU and interpret mode get the
    Triton kernels."""
    from pallas_cases import make_case
    from pallas_kernels.formats import from_layer_kv

    def pages(fmt, dtype="bfloat16"):
        return from_layer_kv(make_case(fmt, dtype, [5], heads=(8, 2), head_dim=64, page=16).layer)

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    for fmt in ("dense", "int8", "fp8_e4m3"):
        assert dispatch.gpu_kernel_family(pages(fmt), 8, decode=True, interpret=False) == "triton"
        assert dispatch.gpu_kernel_family(pages(fmt), 8, decode=False, interpret=False) == "mosaic"
    assert dispatch.gpu_kernel_family(pages("dense", "float32"), 8, decode=False, interpret=False) == "triton"
    for fmt in ("int4", "int2"):
        assert dispatch.gpu_kernel_family(pages(fmt), 8, decode=False, interpret=False) == "triton"
    assert dispatch.gpu_kernel_family(pages("dense"), 8, decode=False, interpret=True) == "triton"
    monkeypatch.setattr(dispatch, "hopper", lambda: False)
    assert dispatch.gpu_kernel_family(pages("dense"), 8, decode=False, interpret=False) == "triton"
    assert not dispatch.hopper()  # this machine has no GPU


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_compiled_gpu_decode_over_kivi_pages_runs_the_reference(fmt):
    """Compiled Triton decode over KIVI pages crashed the process on an H200 (jax 0.11.2): on a
    GPU decode over them is unsupported ("auto" runs the reference, a kernel impl raises);
    prefill, and interpret mode, still take the kernels."""
    from pallas_cases import make_case

    layer = make_case(fmt, "bfloat16", [5], heads=(8, 2), head_dim=64, page=16).layer
    decode_q, prefill_q = jnp.zeros((1, 1, 8, 64), jnp.bfloat16), jnp.zeros((1, 4, 8, 64), jnp.bfloat16)
    assert "crashed the process" in dispatch.unsupported_reason(decode_q, layer, "gpu", interpret=False)
    assert dispatch.unsupported_reason(prefill_q, layer, "gpu", interpret=False) is None
    assert dispatch.unsupported_reason(decode_q, layer, "gpu", interpret=True) is None
    assert dispatch.unsupported_reason(decode_q, layer, "tpu", interpret=False) is None


@pytest.mark.parametrize("kv_cache", ["auto", "int8"])
def test_tiny_model_through_the_mosaic_gpu_kernels(monkeypatch, kv_cache):
    """The dispatch as on a Hopper GPU (interpret mode here): a bf16 tiny model (GQA 4/2, head_dim
    64, pages of 16) prefills a chunk and decodes through the Mosaic GPU kernels; greedy tokens
    equal the reference's, and logits (|logit| up to 5.2) agree within 0.15: bf16 activations
    through two layers; the Triton kernels differ from the reference by 0.05 (bf16 cache) and
    0.09 (int8) on this model."""
    monkeypatch.setattr(dispatch, "gpu_kernel_family", lambda *args: "mosaic")
    called = []
    real_kernel = dispatch._kernel
    monkeypatch.setattr(dispatch, "_kernel", lambda target, kind: called.append((target, kind)) or
                        real_kernel(target, kind))
    config, params = tiny_model(n_heads=4, n_kv_heads=2, head_dim=64, dtype="bfloat16")
    spec = KVCacheSpec(num_pages=9, page_size=16, max_slots=2, max_pages_per_seq=4)

    def run(impl, steps=4):
        kv = init_paged_kv(config, spec, kv_cache=kv_cache)
        kv = kv.replace(block_tables=jnp.asarray(block_table_array([[7, 2, 5, 1], [3, 8, 6, 4]], 4)))
        lengths = jnp.array([19, 6], jnp.int32)
        tokens = jnp.asarray(random_tokens((2, 19), config.vocab_size, seed=3))
        logits, kv = forward(params, config, tokens, jnp.broadcast_to(jnp.arange(19), (2, 19)), kv, num_new=lengths,
                             logits_index=lengths - 1, attention_impl=impl)
        out, all_logits = [jnp.argmax(logits, -1)], [logits]
        for step in range(steps):
            logits, kv = forward(params, config, out[-1][:, None], (lengths + step)[:, None], kv,
                                 logits_index=jnp.zeros(2, jnp.int32), attention_impl=impl)
            out.append(jnp.argmax(logits, -1))
            all_logits.append(logits)
        return np.stack(out, 1), np.stack(all_logits, 1).astype(np.float32)

    ref_tokens, ref_logits = run("reference")
    tokens, logits = run("pallas_gpu")
    assert ("mosaic_gpu", "prefill") in called and ("mosaic_gpu", "decode") in called
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logits, ref_logits, atol=0.15, rtol=0.02)
