"""Trained-draft checkpoints: the on-disk format, written by training and read by the engine.

Only what training changes is stored: the draft's layers and final norm (bf16) and its
`vocab_ids`, in an orbax directory, plus `draft.json`::

    path/
      params/      orbax StandardCheckpointer: {"layers": {"0": {field: bf16[...]}, ...},
                                                "final_norm": bf16[D], "vocab_ids": i32[Vd]}
      draft.json   format, n_layers, the target's shape and name, training figures
                   (written last: only a complete save has it)

The embedding and LM head are the target's (the head cut to `vocab_ids` rows), rebuilt on
load (`drafts.init_draft`). This module is on the inference side: the engine loads drafts
with it and never imports the training code (`jaxinfer.speculative.train`), which saves
with it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading import Model
from jaxinfer.model.params import LayerParams, expected_shapes
from jaxinfer.speculative.drafts.model import DraftModel, init_draft


def shipped_checkpoint(name: str) -> Path:
    """A checkpoint that ships with jaxinfer: under checkpoints/ in a checkout (and an editable
    install), under jaxinfer/checkpoints/ where a wheel installed it (`setup.py`)."""
    package = Path(__file__).resolve().parents[1]
    return next((root / name for root in (package.parent / "checkpoints", package / "checkpoints")
                 if (root / name).is_dir()), package.parent / "checkpoints" / name)


DEFAULT_DRAFT_PATH = shipped_checkpoint("smollm2_draft")
DRAFT_FORMAT = "jaxinfer-trained-draft"
DRAFT_VERSION = 1
DRAFT_FILE = "draft.json"
PARAMS_DIR = "params"
STORED_DTYPE = jnp.bfloat16
# Target fields the draft's weights and head depend on: a target must match them all.
TARGET_SHAPE_FIELDS = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "attn_bias")


def trainable(draft: DraftModel) -> dict:
    """The weights training updates and a checkpoint stores: the layers and the final norm."""
    return {"layers": draft.params.layers, "final_norm": draft.params.final_norm}


def with_trainable(draft: DraftModel, weights: dict) -> DraftModel:
    params = dataclasses.replace(draft.params, layers=tuple(weights["layers"]), final_norm=weights["final_norm"])
    return dataclasses.replace(draft, params=params)


def _stored_tree(layers, final_norm, vocab_ids) -> dict:
    return {"layers": {str(i): dataclasses.asdict(layer) for i, layer in enumerate(layers)},
            "final_norm": final_norm, "vocab_ids": vocab_ids}


def _drop_none(tree: dict) -> dict:
    """Leave out absent biases (None fields): orbax stores arrays only."""
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in tree.items() if v is not None}


def save_trained_draft(draft: DraftModel, target: Model, path: str | Path, figures: dict | None = None) -> Path:
    """Write the draft's trainable weights (bf16) and vocab_ids to a new directory `path`."""
    path = Path(path).absolute()
    if draft.vocab_ids is None:
        raise ValueError("a trained draft needs vocab_ids (its LM head is rebuilt from them on load)")
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty")
    path.mkdir(parents=True, exist_ok=True)
    cast = lambda a: jnp.asarray(a, STORED_DTYPE)  # noqa: E731
    tree = _stored_tree(jax.tree.map(cast, draft.params.layers), cast(draft.params.final_norm),
                        jnp.asarray(draft.vocab_ids, jnp.int32))
    import orbax.checkpoint as ocp  # here, not at module level: 0.4 s on every engine import

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / PARAMS_DIR, _drop_none(tree))
    tc = target.config
    info = {
        "format": DRAFT_FORMAT, "version": DRAFT_VERSION, "n_layers": draft.config.n_layers,
        "vocab_subset": len(draft.vocab_ids), "stored_dtype": jnp.dtype(STORED_DTYPE).name,
        "target": {"name": Path(target.source).name if target.source else "", "arch": tc.arch,
                   **{f: getattr(tc, f) for f in TARGET_SHAPE_FIELDS}},
        "training": figures or {},
    }
    (path / DRAFT_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return path


def read_draft_info(path: str | Path) -> dict:
    """The `draft.json` of a trained-draft directory (checks the format)."""
    file = Path(path) / DRAFT_FILE
    if not file.is_file():
        hint = " (it holds an EAGLE head: use eagle:PATH)" if (Path(path) / "eagle.json").is_file() else ""
        raise FileNotFoundError(f"{path}: not a trained draft directory (no {DRAFT_FILE}){hint}")
    info = json.loads(file.read_text())
    if (info.get("format"), info.get("version")) != (DRAFT_FORMAT, DRAFT_VERSION):
        raise ValueError(f"{file}: unsupported draft format {info.get('format')!r} v{info.get('version')!r}")
    return info


def check_target_matches(info: dict, target_config: ModelConfig) -> None:
    """Raise ValueError naming every field where `target_config` differs from the draft's target."""
    want = info["target"]
    bad = [f"{f}: draft trained for {want[f]!r}, target has {getattr(target_config, f)!r}"
           for f in TARGET_SHAPE_FIELDS if want[f] != getattr(target_config, f)]
    if target_config.mla is not None:
        bad.append("mla: an MLA target is not supported")
    if bad:
        raise ValueError("trained draft does not match the target model (" + "; ".join(bad) + ")")


def load_trained_draft(target: Model, path: str | Path = DEFAULT_DRAFT_PATH) -> DraftModel:
    """Load a draft written by `save_trained_draft` for `target`, in the target's dtype.

    The embedding is the target's and the LM head is rebuilt as the target's head rows
    `vocab_ids`. Raises ValueError when `target` is not the shape the draft was trained for.
    """
    path = Path(path).absolute()
    info = read_draft_info(path)
    check_target_matches(info, target.config)
    n_layers = info["n_layers"]
    config = target.config.replace(n_layers=n_layers, layer_windows=target.config.layer_windows[:n_layers])
    leaf = lambda shape: jax.ShapeDtypeStruct(shape, STORED_DTYPE)  # noqa: E731
    layer = {f: leaf(s) for f, s in expected_shapes(config).items()}
    abstract = _stored_tree([LayerParams(**layer)] * n_layers, leaf((config.d_model,)),
                            jax.ShapeDtypeStruct((info["vocab_subset"],), jnp.int32))
    import orbax.checkpoint as ocp  # here, not at module level: 0.4 s on every engine import

    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.restore(path / PARAMS_DIR, _drop_none(abstract))
    dtype = config.jnp_dtype
    layers = tuple(LayerParams(**{f: jnp.asarray(a, dtype) for f, a in stored["layers"][str(i)].items()})
                   for i in range(n_layers))
    draft = init_draft(target, n_layers, np.asarray(stored["vocab_ids"], np.int32))
    return with_trainable(draft, {"layers": layers, "final_norm": jnp.asarray(stored["final_norm"], dtype)})
