"""Read the key/value metadata of a GGUF file into plain Python values.

A GGUF header is a list of typed fields (`general.architecture`, `llama.block_count`,
`tokenizer.ggml.tokens`, ...). `gguf.GGUFReader` exposes them as raw numpy "parts"; this module
turns each into `str`, `int`, `float`, `bool` or a `list` of those, so that the tokenizer and the
checkpoint loader can share one reader:

    meta = gguf_metadata("model.gguf")
    meta["llama.block_count"]        # 30
    meta["tokenizer.ggml.tokens"]    # ['<|endoftext|>', '<|im_start|>', ...]

The reader memory-maps the file, so reading metadata of a large checkpoint is cheap.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import gguf
import numpy as np

_T = gguf.GGUFValueType
_INT_TYPES = frozenset(
    {_T.UINT8, _T.INT8, _T.UINT16, _T.INT16, _T.UINT32, _T.INT32, _T.UINT64, _T.INT64}
)
_FLOAT_TYPES = frozenset({_T.FLOAT32, _T.FLOAT64})
_NUMERIC_TYPES = _INT_TYPES | _FLOAT_TYPES | {_T.BOOL}

# Pseudo-fields the reader adds for the file header; they are not metadata keys.
_HEADER_PREFIX = "GGUF."


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """A read-only `GGUFReader`, with a `ValueError` naming the file if it is not a GGUF."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/struct errors/... on bad files
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def gguf_metadata(
    source: gguf.GGUFReader | str | os.PathLike, keys: Iterable[str] | None = None
) -> dict[str, Any]:
    """Metadata of a GGUF file (path or open reader) as `{key: python value}`.

    Scalars become `int`/`float`/`bool`/`str`; arrays become lists of those (an array of
    arrays becomes a list of lists). With `keys`, only those keys are decoded (missing keys
    are simply absent from the result), which avoids decoding the large token arrays when
    only the architecture config is wanted.
    """
    reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    wanted = None if keys is None else set(keys)
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith(_HEADER_PREFIX) or (wanted is not None and name not in wanted):
            continue
        out[name] = field_value(field)
    return out


def field_value(field: Any) -> Any:
    """Decode one `gguf.ReaderField` into a Python value (see `gguf_metadata`)."""
    types = list(field.types)
    if not types:
        raise ValueError(f"GGUF field {field.name!r} has no type")
    if types[0] != _T.ARRAY:
        return _scalar(types[0], field.parts[field.data[0]], field.name)
    if len(types) == 2:
        sub = types[1]
        if sub == _T.STRING:
            return [_string(field.parts[i]) for i in field.data]
        if not field.data:
            return []
        _check_scalar_type(sub, field.name)
        # tolist() yields Python int/float/bool for the matching numpy dtype.
        return np.concatenate([np.asarray(field.parts[i]).reshape(-1) for i in field.data]).tolist()
    # Nested arrays: gguf's own decoder knows their layout; use it when this version has it.
    if hasattr(field, "contents"):
        return field.contents()
    raise ValueError(f"GGUF field {field.name!r}: nested arrays are not supported by this gguf version")


def _scalar(vtype: Any, part: np.ndarray, name: str) -> Any:
    if vtype == _T.STRING:
        return _string(part)
    _check_scalar_type(vtype, name)
    return np.asarray(part).reshape(-1)[0].item()


def _check_scalar_type(vtype: Any, name: str) -> None:
    if vtype not in _NUMERIC_TYPES:
        raise ValueError(f"GGUF field {name!r} has unsupported value type {vtype!r}")


def _string(part: np.ndarray) -> str:
    return bytes(np.asarray(part, dtype=np.uint8)).decode("utf-8", errors="replace")
