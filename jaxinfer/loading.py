"""`load_model`: a checkpoint path (or nothing, for the default model) -> a ready `Model`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxinfer.config import ModelConfig
from jaxinfer.model.params import ModelParams
from jaxinfer.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Model:
    """Everything needed to run a model: static config, weights, tokenizer."""

    config: ModelConfig
    params: ModelParams
    tokenizer: Tokenizer | None
    source: str = ""


def load_model(path: str | Path | None = None, dtype: str = "float32", progress: bool = True, place=None) -> Model:
    """Load a `.gguf` file, an HF directory or an orbax directory written by `jaxinfer convert`.

    With no path, the default model (SmolLM2-135M-Instruct) is fetched on first use.
    `place(config, name, array)`: where each GGUF/HF tensor goes as it is read (see `build_params`).
    """
    from jaxinfer.checkpoint import load_checkpoint

    if path is None:
        from jaxinfer.default_model import default_model_path

        path = default_model_path(progress=progress)
    path = Path(path)
    config, params = load_checkpoint(path, dtype=dtype, place=place)
    tokenizer = _load_tokenizer(path)
    if tokenizer is not None and not config.eos_ids and tokenizer.eos_ids:
        config = config.replace(eos_ids=tokenizer.eos_ids)
    return Model(config=config, params=params, tokenizer=tokenizer, source=str(path))


def _load_tokenizer(path: Path) -> Tokenizer | None:
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    if (path / "tokenizer.json").exists():
        return Tokenizer.from_pretrained_dir(path)
    return None
