"""Save and load jaxinfer's own checkpoint format: an orbax checkpoint of `ModelParams`
plus the `ModelConfig` and the tokenizer, in one directory.

    path/
      config.json                 ModelConfig.to_json()
      params/                     orbax StandardCheckpointer checkpoint of the ModelParams pytree
      tokenizer.json, ...         tokenizer, readable by `Tokenizer.from_pretrained_dir(path)`
      jaxinfer_checkpoint.json    marker, written last: only a complete save has it

Restoring builds an abstract target from the config (`abstract_params`), so arrays can be
restored straight into a dtype and, later, into shardings.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import jax

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.config import ModelConfig
from jaxinfer.model.params import ModelParams, expected_shapes, layer_class, without_gemm_weights
from jaxinfer.model.stacking import with_layer_runs
from jaxinfer.tokenizer import Tokenizer

MARKER_FILE = "jaxinfer_checkpoint.json"
FORMAT_NAME = "jaxinfer-orbax"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
# Tokenizer files of an HF directory that `Tokenizer.from_pretrained_dir` reads (or that
# transformers would); copied verbatim when present.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

TokenizerSource = str | os.PathLike | Tokenizer


def is_orbax_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER_FILE).is_file()


def save_orbax(
    config: ModelConfig,
    params: ModelParams,
    path: str | os.PathLike,
    *,
    tokenizer: TokenizerSource | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `config` and `params` (plus the tokenizer, if given) to the directory `path`.

    `tokenizer` is a `.gguf` file (its tokenizer is rebuilt and written as `tokenizer.json`
    and friends), an HF directory (its tokenizer files are copied) or a `Tokenizer`.
    `path` must not exist or be empty, unless `overwrite` and it holds a jaxinfer
    checkpoint. Returns the absolute path. Stacked layers (`jaxinfer.layer_stack`) are stored
    per layer and weights in the checkpoint's layout only (an engine's extra layouts,
    `with_gemm_weights`, are dropped), so a checkpoint does not depend on the layout it was
    saved from.
    """
    path = Path(path).absolute()
    params = with_layer_runs(without_gemm_weights(params), None)
    _check_params_match(config, params)
    _prepare_dir(path, overwrite)
    import orbax.checkpoint as ocp  # ~0.3 s to import: only saving and restoring pay it

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / PARAMS_DIR, params)
    (path / CONFIG_FILE).write_text(config.to_json())
    if tokenizer is not None:
        save_tokenizer(tokenizer, path)
    (path / MARKER_FILE).write_text(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION}) + "\n")
    return path


def load_orbax(
    path: str | os.PathLike, dtype: str | None = None, shardings: Any = None
) -> tuple[ModelConfig, ModelParams]:
    """Read a directory written by `save_orbax`.

    `dtype` (None = as saved) casts on restore and is reflected in the returned config.
    `shardings` is passed through to the restore target: one `jax.sharding.Sharding` for all
    arrays, or a pytree of them shaped like `ModelParams`; None restores to the default device.
    """
    path = Path(path).absolute()
    config = read_orbax_config(path)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    target = abstract_params(config, shardings=shardings)
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return config, checkpointer.restore(path / PARAMS_DIR, target)
    except Exception as error:  # orbax/tensorstore raise many types for missing/corrupt data
        message = f"{path / PARAMS_DIR}: cannot restore orbax checkpoint (truncated or corrupt?): {_root_cause(error)}"
    _collect_quietly()  # outside the handler: the error's frames no longer hold orbax's reads
    raise CheckpointError(message)


def _collect_quietly() -> None:
    """A failed restore leaves orbax's other reads behind as coroutines and futures that,
    when collected, report their errors again: a thousand lines of TensorStore specs on
    stderr, at some later moment. Collect them now, saying nothing."""
    asyncio_log = logging.getLogger("asyncio")
    hook, level = sys.unraisablehook, asyncio_log.level
    sys.unraisablehook, asyncio_log.level = (lambda _: None), logging.CRITICAL + 1
    try:
        gc.collect()
    finally:
        sys.unraisablehook, asyncio_log.level = hook, level


def _root_cause(error: BaseException) -> str:
    """The innermost error's first line: orbax wraps tensorstore's (`OUT_OF_RANGE: Error
    reading "layers.0.wk" ...`) in errors that print the whole TensorStore spec."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def read_orbax_config(path: Path) -> ModelConfig:
    """The `ModelConfig` of a `save_orbax` directory (checks the marker first)."""
    marker = path / MARKER_FILE
    if not marker.is_file():
        raise CheckpointError(f"{path}: not a jaxinfer orbax checkpoint (no {MARKER_FILE})")
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{marker}: cannot read marker: {error}") from error
    if not isinstance(info, dict) or (info.get("format"), info.get("version")) != (FORMAT_NAME, FORMAT_VERSION):
        raise CheckpointError(f"{marker}: unsupported format {info!r}")
    try:
        return ModelConfig.from_json((path / CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError) as error:  # TypeError: missing or unknown field
        raise CheckpointError(f"{path / CONFIG_FILE}: cannot read config: {error}") from error


def abstract_params(config: ModelConfig, shardings: Any = None) -> ModelParams:
    """`ModelParams` of `jax.ShapeDtypeStruct`s in `config.dtype`: the shape `build_params`
    would produce, without allocating anything. `shardings`: see `load_orbax`."""
    dtype = config.jnp_dtype

    def leaf(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    layer_shapes = expected_shapes(config)
    vd = (config.vocab_size, config.d_model)
    tree = ModelParams(
        embed=leaf(vd),
        layers=tuple(
            layer_class(config)(**{f: leaf(s) for f, s in layer_shapes.items()}) for _ in range(config.n_layers)
        ),
        final_norm=leaf((config.d_model,)),
        lm_head=None if config.tie_embeddings else leaf(vd),
    )
    if shardings is None:
        return tree
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def save_tokenizer(source: TokenizerSource, dest: Path) -> None:
    """Put a tokenizer into `dest` so that `Tokenizer.from_pretrained_dir(dest)` rebuilds it."""
    if isinstance(source, Tokenizer):
        write_tokenizer_dir(source, dest)
        return
    source = Path(source)
    if source.is_dir():
        copied = [name for name in HF_TOKENIZER_FILES if (source / name).is_file()]
        if "tokenizer.json" not in copied:
            raise ValueError(f"{source}: no tokenizer.json to copy")
        for name in copied:
            shutil.copyfile(source / name, dest / name)
    elif source.is_file():
        write_tokenizer_dir(Tokenizer.from_gguf(source), dest)
    else:
        raise FileNotFoundError(f"tokenizer source {source} does not exist")


def write_tokenizer_dir(tokenizer: Tokenizer, dest: Path) -> None:
    """Write `tokenizer` as HF files, using only its public attributes:

    tokenizer.json         the `tokenizers` backend, whose post-processor already adds BOS
                           iff `add_bos` (no `add_bos_token` key is written, so
                           `from_pretrained_dir` keeps that post-processor)
    tokenizer_config.json  `bos_token`, `eos_token` (the primary EOS)
    generation_config.json all `eos_ids` (end-of-turn tokens and the like)
    chat_template.jinja    the chat template, when there is one
    """
    tokenizer.backend.save(str(dest / "tokenizer.json"))
    token_config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    (dest / "tokenizer_config.json").write_text(json.dumps(token_config, indent=2) + "\n")
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.eos_ids)}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer.chat_template is not None:
        (dest / "chat_template.jinja").write_text(tokenizer.chat_template)


def _check_params_match(config: ModelConfig, params: ModelParams) -> None:
    """`params` must have exactly the structure, shapes and dtype that `config` implies."""
    expected = abstract_params(config)
    if jax.tree.structure(params) != jax.tree.structure(expected):
        raise ValueError("params do not have the tree structure the config implies (layers, lm_head, biases)")
    for (key, leaf), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(expected)):
        if (leaf.shape, leaf.dtype) != (want.shape, want.dtype):
            raise ValueError(
                f"params{jax.tree_util.keystr(key)} is {leaf.dtype}{list(leaf.shape)}, "
                f"config implies {want.dtype}{list(want.shape)}"
            )


def _prepare_dir(path: Path, overwrite: bool) -> None:
    if path.exists() and any(path.iterdir()):
        if not (overwrite and is_orbax_dir(path)):
            raise FileExistsError(
                f"{path} is not empty (overwrite=True replaces only a jaxinfer checkpoint directory)"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
