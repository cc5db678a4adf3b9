"""Checkpoint loading and saving.

`load_checkpoint(path)` accepts a GGUF file, a Hugging Face directory (`config.json` +
safetensors) or a directory written by `save_orbax`; every loader returns
`(ModelConfig, ModelParams)` with weights in the HF `[out, in]` layout and raises
`CheckpointError` for anything it cannot load.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.gguf_loader import load_gguf, open_gguf_checked
from jaxinfer.checkpoint.hf_loader import SHARD_INDEX, SINGLE_FILE, is_hf_dir, load_hf_dir
from jaxinfer.checkpoint.orbax_io import MARKER_FILE, is_orbax_dir, load_orbax, save_orbax
from jaxinfer.config import ModelConfig
from jaxinfer.gguf_file import is_gguf_file
from jaxinfer.model.params import ModelParams

__all__ = [
    "CheckpointError",
    "is_gguf",
    "load_checkpoint",
    "load_gguf",
    "load_hf_dir",
    "load_orbax",
    "open_gguf_checked",
    "save_orbax",
]


def load_checkpoint(path: str | os.PathLike, dtype: str = "float32", place=None) -> tuple[ModelConfig, ModelParams]:
    """Load any supported checkpoint, weights in `dtype`. Dispatch, in order:

    a file ending in `.gguf` or starting with the GGUF magic -> `load_gguf`
    a directory holding `jaxinfer_checkpoint.json`           -> `load_orbax`
    a directory with config.json + model.safetensors[.index.json] -> `load_hf_dir`

    `place(config, name, array)` (GGUF and HF only) puts each tensor on its devices as it is read.
    """
    path = Path(path)
    if is_gguf(path):
        return load_gguf(path, dtype=dtype, place=place)
    if is_orbax_dir(path):
        return load_orbax(path, dtype=dtype)
    if is_hf_dir(path):
        return load_hf_dir(path, dtype=dtype, place=place)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    pickled = sorted(p.name for p in path.glob("*.bin")) if path.is_dir() else []
    also = (f"; {', '.join(pickled[:2])}: PyTorch pickles are not read (save the model with "
            "safe_serialization=True, transformers' default, to get safetensors)") if pickled else ""
    raise CheckpointError(
        f"{path}: unknown checkpoint format; expected a .gguf file, a Hugging Face directory "
        f"(config.json + {SINGLE_FILE} or {SHARD_INDEX}) or a jaxinfer orbax directory ({MARKER_FILE}){also}"
    )


def is_gguf(path: Path) -> bool:
    """A file named `*.gguf` or starting with the GGUF magic (`load_gguf` reports a bad one)."""
    return path.is_file() and (path.suffix == ".gguf" or is_gguf_file(path))
