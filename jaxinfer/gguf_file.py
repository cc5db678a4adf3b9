"""Read a GGUF file (llama.cpp's format) once: its metadata as plain Python values, its
tensors as memory-mapped bytes.

    gguf = read_gguf("model.gguf")
    gguf.metadata["llama.block_count"]          # 30
    gguf.metadata["tokenizer.ggml.tokens"]      # ['<|endoftext|>', '<|im_start|>', ...]
    gguf.tensors["blk.0.attn_q.weight"].data    # uint8[576, 360]: Q4_1 blocks, one row per output

Why not `gguf.GGUFReader`: it turns every token and merge string into a numpy memmap slice,
which takes seconds for a 49k-token vocabulary; this parser walks the header with `struct`
(~0.1 s) and leaves the tensor bytes in the page cache until they are dequantized.

Layout (little-endian, versions 2 and 3): magic, version, tensor count, key/value count; the
key/value pairs; one info record per tensor (name, ggml dims fastest-first, type, offset);
then, aligned to `general.alignment` (default 32), the tensor data.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

_T = gguf.GGUFValueType
_SCALARS = {  # value type -> struct format
    _T.UINT8: "<B", _T.INT8: "<b", _T.UINT16: "<H", _T.INT16: "<h", _T.UINT32: "<I", _T.INT32: "<i",
    _T.UINT64: "<Q", _T.INT64: "<q", _T.FLOAT32: "<f", _T.FLOAT64: "<d", _T.BOOL: "<?",
}
# Numeric arrays are decoded in one `np.frombuffer(...).tolist()`, not element by element.
_ARRAY_DTYPES = {vtype: np.dtype(fmt) for vtype, fmt in _SCALARS.items()}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file. `shape` is numpy (row-major) order, `[out, in]` for a linear
    weight, i.e. ggml's dims reversed. `data` is the raw bytes, uint8 `[*shape[:-1], row_bytes]`,
    a read-only view of the memory-mapped file: `gguf.quants.dequantize(data, type)` decodes it."""

    name: str
    shape: tuple[int, ...]
    type: gguf.GGMLQuantizationType
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a file starting with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header of a GGUF file and map its tensors. Raises `FileNotFoundError` for a
    missing file and `ValueError` naming the file for anything that is not a readable GGUF
    (wrong magic or version, big-endian, truncated, unknown value or tensor type)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return _parse(path, buffer)
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {e}") from e


def _parse(path: Path, buffer: mmap.mmap) -> GGUFFile:
    reader = _Reader(buffer)
    if reader.bytes(len(MAGIC)) != MAGIC:
        raise ValueError("bad magic")
    version = reader.scalar("<I")
    if version not in _SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version >= 1 << 16 else ""
        raise ValueError(f"unsupported version {version}{hint}; supported: {_SUPPORTED_VERSIONS}")
    n_tensors, n_fields = reader.scalar("<Q"), reader.scalar("<Q")
    metadata = {}
    for _ in range(n_fields):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("<I"))
    infos = [reader.tensor_info() for _ in range(n_tensors)]

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment={alignment!r} is not a power of two")
    data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in infos:
        if name in tensors:
            raise ValueError(f"duplicate tensor {name!r}")
        tensors[name] = GGUFTensor(name, shape, qtype, _tensor_bytes(buffer, name, shape, qtype, data_start + offset))
    return GGUFFile(path, metadata, tensors)


def _tensor_bytes(buffer: mmap.mmap, name: str, shape: tuple[int, ...], qtype, start: int) -> np.ndarray:
    """The bytes of one tensor, uint8 `[*shape[:-1], row_bytes]`, rows of whole quant blocks."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block_size:
        raise ValueError(f"tensor {name!r} of shape {shape} is not made of whole {qtype.name} blocks ({block_size})")
    row_bytes = shape[-1] // block_size * type_size
    n_bytes = row_bytes * math.prod(shape[:-1])
    if start + n_bytes > len(buffer):
        raise ValueError(f"tensor {name!r} ends past the end of the file ({len(buffer)} bytes): truncated")
    return np.frombuffer(buffer, np.uint8, n_bytes, start).reshape(*shape[:-1], row_bytes)


class _Reader:
    """A cursor over the header bytes."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer, self.pos = buffer, 0

    def bytes(self, n: int) -> bytes:
        if self.pos + n > len(self.buffer):
            raise ValueError(f"header ends past the end of the file at byte {self.pos + n}: truncated")
        self.pos += n
        return self.buffer[self.pos - n : self.pos]

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.bytes(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _T.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype != _T.ARRAY:
            raise ValueError(f"unknown value type {vtype} at byte {self.pos}")
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type in _ARRAY_DTYPES:
            dtype = _ARRAY_DTYPES[item_type]
            return np.frombuffer(self.bytes(count * dtype.itemsize), dtype).tolist()
        return [self.value(item_type) for _ in range(count)]

    def tensor_info(self) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
        name = self.string()
        dims = [self.scalar("<Q") for _ in range(self.scalar("<I"))]
        qtype = gguf.GGMLQuantizationType(self.scalar("<I"))
        return name, tuple(reversed(dims)), qtype, self.scalar("<Q")
