"""A dequantized copy of a GGUF file's weights on disk, so that the next load is a memory-mapped read.

Dequantizing takes seconds on every load; the cache keeps what the loader produced (HF layout, in
the requested dtype) as one safetensors file per source file and dtype:

    <cache>/weights/<stem>.<dtype>.<hash of the source's path>.safetensors
    cache = $JAXINFER_CACHE or ~/.cache/jaxinfer          (`jaxinfer.default_model.cache_dir`)

The file's `__metadata__` records what it was made from (`cache_key`: the source's path, size,
mtime and a hash of its first and last MiB, so a same-sized file copied in with its old mtime is
noticed; the dtype, the producing loader's version) and a crc32 of every tensor. A file whose record
differs (stale), whose bytes fail their crc32 or that does not parse (corrupt) is rebuilt, never
used. Files are written under a temporary name and renamed into place, so concurrent loads see a
complete file or none. `JAXINFER_NO_WEIGHT_CACHE=1` turns the cache off (nothing read or written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import mmap
import os
import struct
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import jax.numpy as jnp
import numpy as np

from jaxinfer.default_model import cache_dir

DISABLE_ENV = "JAXINFER_NO_WEIGHT_CACHE"
_FORMAT = "jaxinfer-weight-cache-1"
# safetensors dtype codes of the dtypes we load into (`jaxinfer.config.SUPPORTED_DTYPES`)
_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(jnp.bfloat16)}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_CORRUPT = (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error)

Get = Callable[[str, tuple[int, ...]], np.ndarray]


def enabled() -> bool:
    """False when `$JAXINFER_NO_WEIGHT_CACHE` is set to anything but "" or "0"."""
    return os.environ.get(DISABLE_ENV, "") in ("", "0")


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """Where the cache file of one source and dtype lives, and the record it must carry."""

    file: Path
    record: dict[str, str]


def cache_key(source: Path, dtype: str, producer: str) -> CacheKey:
    """`producer` names the loader and its version: change it when the loader's output changes."""
    source = source.resolve()
    stat = source.stat()
    path_hash = hashlib.sha256(str(source).encode()).hexdigest()[:12]
    return CacheKey(
        file=cache_dir() / "weights" / f"{source.stem}.{dtype}.{path_hash}.safetensors",
        record={"format": _FORMAT, "source": str(source), "size": str(stat.st_size),
                "mtime_ns": str(stat.st_mtime_ns), "ends": _ends_hash(source), "dtype": dtype, "producer": producer},
    )


def _ends_hash(source: Path, span: int = 1 << 20) -> str:
    """sha256 of the file's first and last `span` bytes: its header and the last tensors' data."""
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        digest.update(f.read(span))
        f.seek(max(f.seek(0, os.SEEK_END) - span, 0))
        digest.update(f.read(span))
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def cached(key: CacheKey, produce: Get) -> Iterator[Get]:
    """A `get(name, shape)` for `build_params` that reads `key`'s cache file where it is valid
    and calls `produce` for the rest; if it produced anything and the block completes, it
    (re)writes the cache file with everything it handed out."""
    tensors = read(key) or {}
    handed_out: dict[str, np.ndarray] = {}
    produced = False

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        nonlocal produced
        array = tensors.get(name)
        if array is None or array.shape != shape:  # not cached, or cached for another params layout
            array, produced = produce(name, shape), True
        handed_out[name] = array
        return array

    yield get
    if produced:
        write(key, handed_out)


def read(key: CacheKey) -> dict[str, np.ndarray] | None:
    """The tensors of `key`'s cache file (read-only views of the mapped file), or None when it
    is missing, stale or corrupt (corrupt also warns)."""
    try:
        tensors, metadata = _map_safetensors(key.file)
        if any(metadata.get(k) != v for k, v in key.record.items()):
            return None  # made from another source file, dtype or loader version
        crcs = json.loads(metadata["crc32"])
        bad = sorted(crcs.keys() ^ tensors.keys()) or [n for n, t in tensors.items() if _crc32(t) != crcs[n]]
        if bad:
            raise ValueError(f"tensor {bad[0]!r} fails its crc32")
        return tensors
    except (FileNotFoundError, NotADirectoryError):
        return None
    except _CORRUPT as error:
        warnings.warn(f"weight cache {key.file} is corrupt or unreadable ({error}); rebuilding it")
        return None


def write(key: CacheKey, tensors: dict[str, np.ndarray]) -> None:
    """Write `tensors` as `key`'s cache file (atomically); a failure only warns."""
    tmp = None
    try:
        key.file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key.file.name}.", suffix=".part", dir=key.file.parent)
        with os.fdopen(fd, "wb") as f:
            _write_safetensors(f, tensors, key.record)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shared like any download
        os.replace(tmp, key.file)
    except OSError as error:
        warnings.warn(f"could not write the weight cache {key.file}: {error}")
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(array.reshape(-1).view(np.uint8))


def _write_safetensors(f: BinaryIO, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """The safetensors format: u64 header length, JSON header, the tensors' bytes back to back.

    Not `safetensors.numpy.save_file`, which pads the header to 8 bytes only: padded to 64, most
    tensors start 64-byte aligned, and jax on CPU then uses the mapped bytes in place, uncopied."""
    tensors = {name: np.ascontiguousarray(t) for name, t in tensors.items()}
    crcs = {name: _crc32(t) for name, t in tensors.items()}
    header: dict[str, Any] = {"__metadata__": metadata | {"crc32": json.dumps(crcs)}}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    f.write(struct.pack("<Q", len(text)) + text)
    for t in tensors.values():
        f.write(t.reshape(-1).view(np.uint8).data)


def _map_safetensors(file: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Memory-map a safetensors file: (tensors as read-only views, `__metadata__`).

    Not `safetensors.numpy`: it copies every tensor into memory and has no bfloat16."""
    with open(file, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (header_len,) = struct.unpack_from("<Q", buffer, 0)
    header = json.loads(buffer[8 : 8 + header_len])
    metadata = header.pop("__metadata__", {})
    start = 8 + header_len
    tensors = {}
    for name, info in header.items():
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize or start + end > len(buffer):
            raise ValueError(f"tensor {name!r} has bad data offsets {begin, end}")
        tensors[name] = np.frombuffer(buffer, dtype, count, start + begin).reshape(shape)
    return tensors, metadata
