"""read_gguf: every GGUF value type decodes to the plain Python value that was written, and every
tensor type to the bytes `gguf.GGUFReader` sees."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxinfer.gguf_file import is_gguf_file, read_gguf


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("meta") / "typed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("t.str", "héllo ✓ 😀")
    w.add_key_value("t.empty", "", gguf.GGUFValueType.STRING)  # add_string() skips empty strings
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>", "日本"])
    w.add_array("t.ints", [3, 1, 2])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False])
    w.add_tensor("x", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_values_round_trip(typed_gguf: Path):
    meta = read_gguf(typed_gguf).metadata
    expected = {
        "general.architecture": "llama",
        "t.str": "héllo ✓ 😀",
        "t.empty": "",
        "t.u8": 255,
        "t.i8": -128,
        "t.u16": 65535,
        "t.i16": -32768,
        "t.u32": 2**32 - 1,
        "t.i32": -(2**31),
        "t.u64": 2**64 - 1,
        "t.i64": -(2**63),
        "t.f64": 0.1,
        "t.true": True,
        "t.false": False,
        "t.strs": ["a", "", "Ġthe", "<|im_end|>", "日本"],
        "t.ints": [3, 1, 2],
        "t.floats": [0.5, -1.25],
        "t.bools": [True, False],
    }
    for key, value in expected.items():
        assert meta[key] == value and type(meta[key]) is type(value), key
    assert meta["t.f32"] == float(np.float32(0.1)) and isinstance(meta["t.f32"], float)
    assert not any(k.startswith("GGUF.") for k in meta)  # reader pseudo-fields are not metadata


def test_bad_files(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        read_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_gguf(bad)
    assert not is_gguf_file(bad) and not is_gguf_file(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0, 7, 24, 100])
def test_truncated_header_is_a_value_error(typed_gguf: Path, tmp_path: Path, keep: int):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(typed_gguf.read_bytes()[:keep])
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_gguf(cut)


_QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def typed_tensors_gguf(tmp_path_factory) -> Path:
    """One tensor per type, of random bytes (any bytes are a valid block), two rows of 512."""
    path = tmp_path_factory.mktemp("tensors") / "tensors.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)  # not the default 32: the reader must honour general.alignment
    for name in _QTYPES:
        qtype = gguf.GGMLQuantizationType[name]
        raw = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape((2, 512), qtype), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tensors_match_gguf_reader(typed_tensors_gguf: Path):
    ours = read_gguf(typed_tensors_gguf).tensors
    theirs = gguf.GGUFReader(str(typed_tensors_gguf)).tensors
    assert sorted(ours) == sorted(_QTYPES)
    for ref in theirs:
        tensor = ours[ref.name]
        assert tensor.type == ref.tensor_type and tensor.shape == (2, 512)
        with np.errstate(all="ignore"):  # random scales may be inf or nan
            want = gguf.quants.dequantize(ref.data, ref.tensor_type)
            got = gguf.quants.dequantize(tensor.data, tensor.type)
        assert got.shape == (2, 512) and np.array_equal(got, want, equal_nan=True), ref.name


def test_truncated_tensor_data(typed_tensors_gguf: Path, tmp_path: Path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(typed_tensors_gguf.read_bytes()[:-100])  # the writer pads the last tensor to 64
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(cut)


@pytest.mark.slow
def test_smollm2_metadata(smollm2_gguf: Path):
    meta = read_gguf(smollm2_gguf).metadata
    assert meta["general.architecture"] == "llama"
    assert (meta["llama.block_count"], meta["llama.embedding_length"], meta["llama.attention.head_count_kv"]) == (30, 576, 3)
    assert meta["llama.rope.freq_base"] == 100000.0
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert meta["tokenizer.ggml.token_type"][:3] == [3, 3, 3]
    assert meta["tokenizer.ggml.pre"] == "smollm" and meta["tokenizer.ggml.add_bos_token"] is False
