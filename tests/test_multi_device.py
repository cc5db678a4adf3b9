"""Sharded engine, pmap entry and a two-process `jax.distributed` run on simulated CPU devices.

Each group of checks runs `tests/multi_device_checks.py` in a subprocess, which sets
`XLA_FLAGS=--xla_force_host_platform_device_count=N` before importing jax, and reads
the JSON object it prints last. Greedy tokens must equal the single-device run exactly,
logits within 1e-5 (f32; the sharded sums differ only in reduction order).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from multi_device_cases import DEFAULT_RINGS, DEFAULT_SCAN, DEFAULT_VARIANTS, MESHES, RINGS, SCAN, VARIANTS

CHECKS = Path(__file__).parent / "multi_device_checks.py"
ROOT = Path(__file__).parent.parent


def _env(**extra: str) -> dict[str, str]:
    keep = ("JAXINFER_COMPILATION_CACHE", "JAXINFER_NO_WEIGHT_CACHE")  # the suite's: write nothing to the user's caches
    env = {k: v for k, v in os.environ.items() if (k in keep or not k.startswith("JAXINFER_")) and k != "XLA_FLAGS"}
    return env | {"JAX_PLATFORMS": "cpu"} | extra


def _parse(proc: subprocess.CompletedProcess | tuple[int, str, str]) -> dict:
    rc, out, err = (proc.returncode, proc.stdout, proc.stderr) if hasattr(proc, "returncode") else proc
    assert rc == 0, f"checks failed (rc={rc}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def run_checks(mode: str, devices: int = 8, timeout: int = 900) -> dict:
    proc = subprocess.run([sys.executable, str(CHECKS), mode, str(devices)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_env())
    return _parse(proc)


@pytest.fixture(scope="module")
def meshes() -> dict:
    return run_checks("meshes")


@pytest.fixture(scope="module")
def meshes_more() -> dict:
    return run_checks("meshes_more")


def cases(all_cases, default_cases) -> list:
    """Test parameters: the cases beyond the default ones are extended."""
    return [c if c in default_cases else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.extended)
            for c in all_cases]


def bundle(request, default: bool) -> dict:
    """The `meshes` results for a default case, `meshes_more` for an extended one."""
    return request.getfixturevalue("meshes" if default else "meshes_more")


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_engine_tokens_equal_single_device(meshes, spec):
    assert meshes["meshes"][spec]["tokens"] == meshes["ref_tokens"]


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_logits_match_single_device(meshes, spec):
    assert meshes["meshes"][spec]["max_logit_diff"] < 1e-5


# 4 KV heads, page_size 4, head_dim 8: (data, model) -> (stored heads, heads one device holds)
KV_HEADS_HELD = {"data=1,model=8": (8, 1), "data=2,model=4": (4, 1), "data=8,model=1": (4, 4)}


@pytest.mark.parametrize("spec", MESHES)
def test_each_device_holds_its_share_of_pages_and_kv_heads(meshes, spec):
    """Pages split over data, stored KV heads over model. On model=8 the 4 KV heads are kept
    twice (`kv_head_copies`), so each device holds one head (a quarter of the bytes, not a
    full replica) and attends with its own query head; tokens and logits still match above."""
    m = meshes["meshes"][spec]
    data = int(spec.split(",")[0].split("=")[1])
    stored, held = KV_HEADS_HELD[spec]
    assert m["pages"]["k_shape"] == [m["num_pages"], 4, stored, 8]
    assert m["pages"]["k_shard_shape"] == [m["num_pages"] // data, 4, held, 8]
    assert m["pages"]["k_spec"] == ["data", None, "model"]


@pytest.mark.parametrize("case,stored,held", [("gqa3_model2", 6, 3), ("mqa_model8_int8", 8, 1)])
def test_kv_heads_the_model_axis_does_not_divide_are_copied(meshes, case, stored, held):
    c = meshes["kv_copies"][case]
    assert c["mesh"] == c["ref"]
    assert c["pages"]["k_shape"][2] == stored and c["pages"]["k_shard_shape"][2] == held
    assert c["pages"]["k_spec"] == ["data", None, "model"]


def test_page_pool_is_divided_over_data_and_heads_over_model(meshes):
    """data=2,model=4: each device holds half the pages and one of the four KV heads; every
    request's pages come from its own replica's half (both replicas serve). The step is
    compiled with these shardings declared, and with max_prefill_rows=1 each replica still
    gets a prefill row of its own (2 rows, one per replica's devices)."""
    pool = meshes["pool"]
    assert pool["k_spec"] == pool["k_in_spec"] == ["data", None, "model"]
    assert pool["prefill_rows"] == 2 and pool["prefill_shard_shape"] == [1, 8] and pool["prefill_in_spec"] == ["data"]
    assert pool["k_shard_shape"] == [pool["num_pages"] // 2, 4, 1, 8] and pool["k_shape"][0] == pool["num_pages"]
    assert pool["in_own_replica"] and pool["replicas_used"] == [0, 1]


def test_pallas_kernels_run_per_device_under_shard_map(meshes):
    """attention_impl="pallas" (interpret mode here) on data=2,model=4 gives the reference's tokens."""
    assert meshes["pallas"]["tokens"] == meshes["ref_tokens"]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_caches_on_a_mesh_equal_one_device(meshes, fmt):
    """int8 pages run per device like dense ones; KIVI int4 (per-slot tails) is left to GSPMD."""
    assert meshes["kv_formats"][fmt]["mesh"] == meshes["kv_formats"][fmt]["ref"]


@pytest.mark.parametrize("source", ["ngram", "self", "draft"])
def test_greedy_speculation_on_a_mesh_equals_plain_decoding(meshes, source):
    """data=2,model=4: drafts, verification and a separate draft's pages all sharded."""
    assert meshes["speculative"][source] == meshes["ref_tokens"]


def test_penalties_on_a_mesh_equal_single_device(meshes):
    """Penalized and plain requests side by side on data=2,model=4, plain and speculating
    with a sharded draft model: the replicated penalty histories give the single-device tokens."""
    assert meshes["penalties"]["mesh"] == meshes["penalties"]["ref"] == meshes["penalties"]["mesh_draft"]
    assert meshes["penalties"]["ref"][0] != meshes["ref_tokens"][0]  # the penalties changed something


@pytest.mark.parametrize("variant", cases(VARIANTS, DEFAULT_VARIANTS))
def test_attention_variants_on_a_mesh_equal_one_device(request, variant):
    c = bundle(request, variant in DEFAULT_VARIANTS)["variants"][variant]
    assert c["mesh"] == c["ref"]


# stored KV heads (2 heads, kept twice on model=4) -> heads one device holds
RING_HEADS = {"data=2,model=2": (2, 1), "data=2,model=4": (4, 1)}


@pytest.mark.parametrize("model,spec", cases(RINGS, DEFAULT_RINGS))
def test_window_rings_on_a_mesh_equal_one_device(request, model, spec):
    """A hybrid model's windowed layers keep their bounded ring pool on a mesh: 8 slots x 5 ring
    pages + a spare page per data replica, each device holding its replica's half (its slots'
    rings) and its share of the KV heads, as bounded as on one device; greedy tokens equal, also
    for 4 requests hitting a cached 40-token prefix (10 pages each)."""
    c = bundle(request, (model, spec) in DEFAULT_RINGS)["rings"][f"{model} {spec}"]
    assert c["mesh"] == c["ref"] and c["prefix_hits"] >= 4 * 10
    stored, held = RING_HEADS[spec]
    assert c["window_ring"] == 5 and c["ring_k_shape"][:3] == [2 * (4 * 5 + 1), 4, stored]
    assert c["ring_k_shard_shape"][:3] == [4 * 5 + 1, 4, held] and c["ring_k_spec"] == ["data", None, "model"]


@pytest.mark.parametrize("case", cases(SCAN, DEFAULT_SCAN))
def test_scanned_layers_on_a_mesh_equal_one_device(request, case):
    c = bundle(request, case in DEFAULT_SCAN)["scan"][case]
    assert c["mesh"] == c["ref"]


def test_orbax_restores_straight_into_shardings(meshes):
    o = meshes["orbax"]
    assert o["equal"]
    assert o["wq_spec"] == ["model", None]
    assert o["wq_shard_shape"] == [8 * 8 // 4, 32]  # n_heads * head_dim rows split 4 ways


def test_gguf_tensors_are_placed_into_shards_as_they_are_read(meshes):
    g = meshes["gguf"]
    assert g["equal"] and g["all_on_mesh"]
    assert g["wq_spec"] == ["model", None] and g["wk_spec"] == ["model", None]
    assert g["wq_shard_shape"] == [8 * 8 // 4, 64]


def test_bad_meshes_raise_clear_errors(meshes):
    e = meshes["errors"]
    assert "n_heads=6" in e["heads"] and "model=4" in e["heads"]
    assert "'batch'" in e["axis_name"] and "('data', 'model')" in e["axis_name"]
    assert "16 devices" in e["device_count"] and "8 are available" in e["device_count"]
    assert "max_slots=6" in e["slots"] and "data=8" in e["slots"]
    assert "num_pages=33" in e["pages"] and "data=2" in e["pages"]
    assert "n_heads=6" in e["engine_heads"]
    assert "('dp', 'tp')" in e["engine_axis_names"] and "must be ('data', 'model')" in e["engine_axis_names"]
    assert "must be Auto" in e["explicit_axes"] and "Explicit" in e["explicit_axes"]
    assert "slot 1 (data replica 1 of 2) holds page 3" in e["forward_replica_pages"]


def test_pmap_generate_agrees_with_engine():
    res = run_checks("pmap")
    assert res["tokens"] == res["ref_tokens"]
    assert res["max_logit_diff"] < 1e-5


@pytest.mark.extended
@pytest.mark.slow
def test_smollm2_data_parallel(smollm2_gguf):
    """Data-parallel over 8 devices (9 / 3 heads allow model=1 or 3): greedy tokens equal, and
    the logits agree within 1e-6 of the largest logit (~3e-5) with one device computing each
    prompt alone. Not bit for bit: a lone LM-head row there takes the gemv form of
    `linear`, while each replica's row of the partitioned 8-row batch takes the GEMM form
    (they differ by ~2e-5, f32 rounding of 576-term sums).

    Against one device running all 8 prompts as one batch they differ by ~5e-5 (|logit| ~ 31):
    XLA:CPU's GEMMs sum in a different order for a different batch size, and one device alone
    shows the same difference between the batch and one prompt at a time, so it is not the
    sharding; that comparison is bounded at 1e-5 relative to the largest logit."""
    res = run_checks("smollm", timeout=900)
    assert res["tokens"] == res["ref_tokens"]
    assert res["max_logit_diff_same_shapes"] < 1e-6 * res["max_abs_logit"]
    assert res["max_logit_diff"] < 1e-5 * res["max_abs_logit"]
    assert res["max_logit_diff"] <= 2 * res["batch_vs_per_row_one_device"] + 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_distributed_run_agrees():
    """Two processes x 4 CPU devices on localhost form one data=2,model=4 mesh (gloo):
    process 0 schedules, process 1 runs the programs it publishes (`Engine.follow`)."""
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, str(CHECKS), "distributed", "4"], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env(JAXINFER_COORDINATOR=f"127.0.0.1:{port}", JAXINFER_NUM_PROCESSES="2",
                                  JAXINFER_PROCESS_ID=str(i)))
        for i in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=400)
            results.append(_parse((p.returncode, out, err)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["processes"] == 2 and r["devices"] == 8 for r in results)
    assert results[0]["tokens"] == results[0]["ref_tokens"]
    assert "follows process 0" in results[1]["add_request_error"]
    assert results[1]["followed_steps"] > 6  # every step (and logprob program), then "stop"
    assert results[0]["max_logit_diff"] < 1e-5


def test_mesh_spec_parsing():
    from jaxinfer.sharding import parse_mesh_spec

    assert parse_mesh_spec("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh_spec("model=3") == {"data": 1, "model": 3}
    for bad, words in [("data=2,data=2", "twice"), ("data:2", "model=4"), ("model=0", ">= 1"), ("", "data=2")]:
        with pytest.raises(ValueError, match=words):
            parse_mesh_spec(bad)


def test_initialize_distributed_needs_all_three(monkeypatch):
    from jaxinfer.sharding import initialize_distributed

    for k in ("JAXINFER_COORDINATOR", "JAXINFER_NUM_PROCESSES", "JAXINFER_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    assert initialize_distributed() is False  # nothing configured: single process
    with pytest.raises(ValueError, match="num_processes"):
        initialize_distributed(coordinator="127.0.0.1:1234")
    with pytest.raises(ValueError, match="process_id=2"):
        initialize_distributed(coordinator="127.0.0.1:1234", num_processes=2, process_id=2)


def test_cli_rejects_bad_mesh_before_loading():
    proc = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", "--mesh", "data=3", "hi"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    assert proc.returncode == 2 and "needs 3 devices, but 8 are available" in proc.stderr, proc.stderr[-2000:]


def _post(port: int, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _get(port: int, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def _pages_used(port: int) -> float:
    _, text = _get(port, "/metrics")
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("jaxinfer_kv_pages_used ")))


@pytest.mark.extended
def test_two_process_serve_has_one_scheduler(tmp_path, smollm2_gguf):
    """`jaxinfer serve` over two processes x 2 CPU devices (one data=2 mesh, gloo): process 0
    schedules and answers HTTP, process 1 runs the programs it publishes. The answers equal
    one process's; a request aborted mid-stream returns its pages and the processes stay in
    step; SIGTERM on process 0 drains it and releases process 1: both exit 0."""
    import http.client
    import signal
    import time

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import tiny_model

    from jaxinfer.checkpoint import save_orbax
    from jaxinfer.engine import Engine, EngineConfig
    from jaxinfer.loading import Model
    from jaxinfer.sampling import SamplingParams
    from jaxinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf)
    config, params = tiny_model(vocab_size=tok.vocab_size, eos_ids=tok.eos_ids)
    save_orbax(config, params, tmp_path / "tiny", tokenizer=tok)
    prompts = ["The quick brown fox", "Über café", "def f(x):"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.text for o in Engine(Model(config, params, tok), EngineConfig(max_slots=4, max_model_len=64)).generate(prompts, greedy)]

    coordinator, http_port = _free_port(), _free_port()
    flags = ["--model", str(tmp_path / "tiny"), "--mesh", "data=2,model=2", "--max-slots", "4", "--max-model-len", "64",
             "--page-size", "4", "--prefill-chunk", "8", "--port", str(http_port), "--grace-period", "5",
             "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2"]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", *flags, "--process-id", str(i)], cwd=ROOT,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"))
             for i in range(2)]
    try:
        deadline = time.monotonic() + 400
        while _get(http_port, "/health")[0] != 200:
            assert all(p.poll() is None for p in procs), "a serve process exited early"
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(1)
        body = lambda prompt, **kw: {"model": str(tmp_path / "tiny"), "prompt": prompt, "max_tokens": 8, "temperature": 0,  # noqa: E731
                                     "ignore_eos": True, **kw}
        assert [_post(http_port, body(p))["choices"][0]["text"] for p in prompts] == want

        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)  # abort mid-stream
        conn.request("POST", "/v1/completions", json.dumps(body(prompts[0], max_tokens=48, stream=True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.fp.readline()  # the first event: the request runs
        conn.close()
        while _pages_used(http_port) > 0:
            assert time.monotonic() < deadline, "the aborted request kept its pages"
            time.sleep(0.5)
        assert _post(http_port, body(prompts[1]))["choices"][0]["text"] == want[1]  # still in step

        procs[0].send_signal(signal.SIGTERM)
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
