"""The weight cache of dequantized GGUF tensors, and `load_model`'s one parse of a GGUF file.

Every test that writes a cache points `$JAXINFER_CACHE` at its own temp dir (`cache` fixture);
conftest turns the cache off for all other tests."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors
from test_checkpoint import TOKENIZER_TEXTS, flat, tiny_config, write_gguf

from jaxinfer import gguf_file
from jaxinfer.checkpoint import gguf_loader, load_gguf, progress, weight_cache
from jaxinfer.loading import load_model
from jaxinfer.model import init_random_params
from jaxinfer.tokenizer import Tokenizer

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    """The weights folder of a fresh cache, with the cache turned on."""
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAXINFER_NO_WEIGHT_CACHE")
    return tmp_path / "cache" / "weights"


def write_quantized(path: Path, seed: int = 0, qtype=Q4_1) -> Path:
    config = tiny_config(ffn_dim=64)  # quantized rows must be whole 32-wide blocks
    return write_gguf(path, config, flat(init_random_params(config, seed=seed, scale=0.3)), qtype=qtype)


@pytest.fixture
def q_gguf(tmp_path: Path) -> Path:
    return write_quantized(tmp_path / "q.gguf")


def cache_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.safetensors")) if cache.exists() else []


def assert_bit_identical(a, b) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name].dtype == fb[name].dtype and fa[name].shape == fb[name].shape, name
        assert np.array_equal(fa[name].view(np.uint8), fb[name].view(np.uint8)), name


def forbid_dequantizing(monkeypatch) -> None:
    """From now on, a load that succeeds read its weights from the cache."""

    def fail(*args):
        raise AssertionError("dequantized although the weight cache was valid")

    monkeypatch.setattr(gguf.quants, "dequantize", fail)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=lambda q: q.name)
def test_cached_load_is_bit_identical_to_a_fresh_load(tmp_path, cache, monkeypatch, dtype, qtype):
    path = write_quantized(tmp_path / "q.gguf", qtype=qtype)
    config, fresh = load_gguf(path, dtype, weight_cache=False)
    assert cache_files(cache) == []
    assert_bit_identical(load_gguf(path, dtype, weight_cache=True)[1], fresh)  # writes the cache
    [file] = cache_files(cache)
    assert dtype in file.name

    forbid_dequantizing(monkeypatch)
    cached_config, cached = load_gguf(path, dtype, weight_cache=True)
    assert cached_config == config
    assert_bit_identical(cached, fresh)
    if dtype == "float32":  # a standard safetensors file (numpy has no bfloat16 to compare with)
        with safetensors.safe_open(file, framework="numpy") as f:
            assert {k: f.get_tensor(k) for k in f.keys()}.keys() == flat(fresh).keys()
            assert np.array_equal(f.get_tensor("layers.1.wk"), flat(fresh)["layers.1.wk"])


def test_one_cache_file_per_dtype_holding_that_dtype(q_gguf, cache):
    load_gguf(q_gguf, "float32", weight_cache=True)
    load_gguf(q_gguf, "bfloat16", weight_cache=True)
    f32, bf16 = (next(cache.glob(f"*.{dtype}.*")).stat().st_size for dtype in ("float32", "bfloat16"))
    assert len(cache_files(cache)) == 2 and bf16 < 0.6 * f32


@pytest.mark.parametrize("mtime", ["newer", "kept"])
def test_a_changed_source_file_rebuilds_the_cache(q_gguf, cache, monkeypatch, mtime):
    """Another file of the same size at the same path, with a newer mtime or the old one kept
    (as `cp -p`, `rsync -t` or `tar x` leave it)."""
    load_gguf(q_gguf, weight_cache=True)
    before = q_gguf.stat()
    write_quantized(q_gguf, seed=1)  # same path, same size, new weights
    assert q_gguf.stat().st_size == before.st_size
    shift = 10**9 if mtime == "newer" else 0  # newer: even on a coarse clock
    os.utime(q_gguf, ns=(before.st_atime_ns, before.st_mtime_ns + shift))
    fresh = load_gguf(q_gguf, weight_cache=False)[1]
    assert_bit_identical(load_gguf(q_gguf, weight_cache=True)[1], fresh)
    assert len(cache_files(cache)) == 1  # the stale file was replaced, not kept beside
    forbid_dequantizing(monkeypatch)
    assert_bit_identical(load_gguf(q_gguf, weight_cache=True)[1], fresh)


def test_a_new_loader_version_rebuilds_the_cache(q_gguf, cache, monkeypatch):
    load_gguf(q_gguf, weight_cache=True)
    calls = []
    dequantize = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(1) or dequantize(*a))
    load_gguf(q_gguf, weight_cache=True)
    assert not calls
    monkeypatch.setattr(gguf_loader, "LOADER_VERSION", gguf_loader.LOADER_VERSION + 1)
    load_gguf(q_gguf, weight_cache=True)
    assert calls


def test_tensors_the_cache_lacks_are_produced_and_added(q_gguf, cache, monkeypatch):
    """E.g. after the params layout changed: what matches is used, the rest dequantized."""
    fresh = load_gguf(q_gguf, weight_cache=True)[1]
    key = gguf_loader.weight_cache_key(q_gguf, "float32")
    weight_cache.write(key, {n: a for n, a in flat(fresh).items() if n != "layers.1.wk"})
    calls = []
    dequantize = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(1) or dequantize(*a))
    assert_bit_identical(load_gguf(q_gguf, weight_cache=True)[1], fresh)
    assert len(calls) == 1
    forbid_dequantizing(monkeypatch)  # the file was completed
    assert_bit_identical(load_gguf(q_gguf, weight_cache=True)[1], fresh)


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


CORRUPTIONS = {
    "flipped data byte": _flip_last_byte,
    "truncated": lambda data: data[: len(data) // 2],
    "garbage header": lambda data: b"\xff" * 16 + data[16:],
    "empty": lambda data: b"",
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_a_corrupt_cache_file_is_rebuilt(q_gguf, cache, monkeypatch, corrupt):
    fresh = load_gguf(q_gguf, weight_cache=True)[1]
    [file] = cache_files(cache)
    file.write_bytes(corrupt(file.read_bytes()))
    with pytest.warns(UserWarning, match="corrupt"):
        assert_bit_identical(load_gguf(q_gguf, weight_cache=True)[1], fresh)
    forbid_dequantizing(monkeypatch)  # rebuilt: valid again
    assert_bit_identical(load_gguf(q_gguf, weight_cache=True)[1], fresh)


def test_opting_out_writes_nothing(q_gguf, cache, monkeypatch):
    load_gguf(q_gguf)  # off by default for the library call
    load_model(q_gguf, progress=False, weight_cache=False)
    monkeypatch.setenv("JAXINFER_NO_WEIGHT_CACHE", "1")
    load_model(q_gguf, progress=False)
    assert not cache.parent.exists()
    monkeypatch.setenv("JAXINFER_NO_WEIGHT_CACHE", "0")
    load_model(q_gguf, progress=False)  # on by default for load_model
    assert len(cache_files(cache)) == 1


def test_float_files_are_not_cached(tmp_path, cache):
    config = tiny_config()
    path = write_gguf(tmp_path / "f32.gguf", config, flat(init_random_params(config)))
    load_model(path, progress=False)
    assert cache_files(cache) == []


def test_an_unwritable_cache_only_warns(q_gguf, tmp_path, monkeypatch):
    monkeypatch.delenv("JAXINFER_NO_WEIGHT_CACHE")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "file"))  # a file, so no weights/ inside
    with pytest.warns(UserWarning, match="could not write the weight cache"):
        params = load_gguf(q_gguf, weight_cache=True)[1]
    assert_bit_identical(params, load_gguf(q_gguf)[1])


# --- one parse for weights and tokenizer --------------------------------------------------------


def reader_metadata(path: Path) -> dict:
    """Metadata as `gguf.GGUFReader` decodes it: what the tokenizer was built from before."""
    fields = gguf.GGUFReader(str(path)).fields
    return {name: field.contents() for name, field in fields.items() if not name.startswith("GGUF.")}


def assert_same_ids(got: Tokenizer, want: Tokenizer, texts) -> None:
    assert (got.bos_id, got.eos_ids, got.add_bos, got.chat_template) == (
        want.bos_id, want.eos_ids, want.add_bos, want.chat_template)
    for text in texts:
        assert got.encode(text) == want.encode(text), text


def test_load_model_parses_the_file_once(q_gguf, monkeypatch):
    parses = []
    parse = gguf_file._parse
    monkeypatch.setattr(gguf_file, "_parse", lambda path, buffer: parses.append(path) or parse(path, buffer))
    model = load_model(q_gguf, progress=False)
    assert parses == [q_gguf]
    assert_same_ids(model.tokenizer, Tokenizer.from_gguf_metadata(reader_metadata(q_gguf)), TOKENIZER_TEXTS)


@pytest.mark.slow
def test_smollm2_tokenizer_from_the_shared_parse(smollm2_gguf):
    model = load_model(smollm2_gguf, progress=False)
    want = Tokenizer.from_gguf_metadata(reader_metadata(smollm2_gguf))
    texts = ["Hello, world!", "The 2 quick brown foxes, naïvely: 123456!\n\tok", "日本語 😀",
             "<|im_start|>user\nhi<|im_end|>\n"]
    assert_same_ids(model.tokenizer, want, texts)


# --- progress -----------------------------------------------------------------------------------


def test_progress_bar_only_when_asked_and_slow(q_gguf, capfd, monkeypatch):
    load_model(q_gguf)  # quick: under progress.DELAY_S, so no bar
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)  # as if every load were slow
    load_model(q_gguf, progress=False)
    assert capfd.readouterr().err == ""
    load_model(q_gguf)
    assert "loading q.gguf" in capfd.readouterr().err
