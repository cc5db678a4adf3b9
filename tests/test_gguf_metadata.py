"""gguf_metadata: every GGUF value type decodes to the plain Python value that was written."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxinfer.gguf_metadata import gguf_metadata, open_gguf


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
    meta = gguf_metadata(typed_gguf)
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


def test_key_filter_and_open_reader(typed_gguf: Path):
    reader = gguf.GGUFReader(str(typed_gguf))
    assert gguf_metadata(reader, keys=["t.u8", "t.strs", "missing"]) == {"t.u8": 255, "t.strs": ["a", "", "Ġthe", "<|im_end|>", "日本"]}


def test_bad_files(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        open_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        gguf_metadata(bad)


@pytest.mark.slow
def test_smollm2_metadata(smollm2_gguf: Path):
    meta = gguf_metadata(smollm2_gguf)
    assert meta["general.architecture"] == "llama"
    assert (meta["llama.block_count"], meta["llama.embedding_length"], meta["llama.attention.head_count_kv"]) == (30, 576, 3)
    assert meta["llama.rope.freq_base"] == 100000.0
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert meta["tokenizer.ggml.token_type"][:3] == [3, 3, 3]
    assert meta["tokenizer.ggml.pre"] == "smollm" and meta["tokenizer.ggml.add_bos_token"] is False
