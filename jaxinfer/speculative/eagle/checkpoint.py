"""EAGLE head checkpoints: `EagleParams` (bf16) and the vocabulary subset, in orbax::

    path/
      params/     orbax StandardCheckpointer: {"params": EagleParams as a dict, "vocab_ids": i32[Vd]}
      eagle.json  format, the target's shape and name, the tapped layers (EAGLE-3 fusion),
                  training figures (written last)

The embedding and LM head are the target's, bound on load (`head.bind_head`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.loading import Model
from jaxinfer.model.params import LayerParams, expected_shapes
from jaxinfer.speculative.checkpoint import (DRAFT_FILE, STORED_DTYPE, TARGET_SHAPE_FIELDS, check_target_matches,
                                             shipped_checkpoint)
from jaxinfer.speculative.eagle.head import EagleHead, EagleParams, bind_head

DEFAULT_EAGLE_PATH = shipped_checkpoint("smollm2_eagle")
EAGLE_FORMAT = "jaxinfer-eagle-head"
EAGLE_VERSION = 1
EAGLE_FILE = "eagle.json"
PARAMS_DIR = "params"


def _tree(params: EagleParams, vocab_ids) -> dict:
    # the arrays (a head without fusion has no fusion arrays); feature_layers go to eagle.json
    p = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
         if f.name != "feature_layers" and getattr(params, f.name) is not None}
    p["layer"] = {f: v for f, v in dataclasses.asdict(params.layer).items() if v is not None}
    return {"params": p, "vocab_ids": vocab_ids}


def save_eagle_head(params: EagleParams, vocab_ids: np.ndarray, target: Model, path: str | Path,
                    figures: dict | None = None) -> Path:
    """Write a trained head (bf16) to a new directory `path`."""
    bind_head(target, params, vocab_ids)  # checked before anything is written
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty")
    path.mkdir(parents=True, exist_ok=True)
    cast = jax.tree.map(lambda a: jnp.asarray(a, STORED_DTYPE), params)
    import orbax.checkpoint as ocp  # here, not at module level: 0.4 s on every engine import

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / PARAMS_DIR, _tree(cast, jnp.asarray(vocab_ids, jnp.int32)))
    tc = target.config
    info = {"format": EAGLE_FORMAT, "version": EAGLE_VERSION, "vocab_subset": int(len(vocab_ids)),
            "stored_dtype": jnp.dtype(STORED_DTYPE).name, "feature_layers": list(params.feature_layers),
            "target": {"name": Path(target.source).name if target.source else "", "arch": tc.arch,
                       **{f: getattr(tc, f) for f in TARGET_SHAPE_FIELDS}},
            "training": figures or {}}
    (path / EAGLE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return path


def read_eagle_info(path: str | Path) -> dict:
    file = Path(path) / EAGLE_FILE
    if not file.is_file():
        hint = " (it holds a trained draft: use draft:PATH)" if (Path(path) / DRAFT_FILE).is_file() else ""
        raise FileNotFoundError(f"{path}: not an EAGLE head directory (no {EAGLE_FILE}){hint}")
    info = json.loads(file.read_text())
    if (info.get("format"), info.get("version")) != (EAGLE_FORMAT, EAGLE_VERSION):
        raise ValueError(f"{file}: unsupported format {info.get('format')!r} v{info.get('version')!r}")
    return info


def load_eagle_head(target: Model, path: str | Path = DEFAULT_EAGLE_PATH) -> EagleHead:
    """Load a head written by `save_eagle_head` for `target`; raises ValueError naming every
    shape field where `target` differs from the model it was trained for."""
    path = Path(path).absolute()
    info = read_eagle_info(path)
    check_target_matches(info, target.config)
    c = target.config
    feature_layers = tuple(info.get("feature_layers", ()))  # heads saved before fusion have none
    leaf = lambda *shape: jax.ShapeDtypeStruct(shape, STORED_DTYPE)  # noqa: E731
    layer = LayerParams(**{f: leaf(*s) for f, s in expected_shapes(c).items()})
    n, d = len(feature_layers), c.d_model
    fusion = dict(tap_norms=leaf(n, d), fuse=leaf(d, n * d), feature_layers=feature_layers) if n else {}
    abstract = EagleParams(embed_norm=leaf(d), feature_norm=leaf(d), fc=leaf(d, 2 * d), layer=layer, final_norm=leaf(d),
                           **fusion)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.restore(path / PARAMS_DIR,
                                      _tree(abstract, jax.ShapeDtypeStruct((info["vocab_subset"],), jnp.int32)))
    p = stored["params"]
    params = EagleParams(**{**p, "layer": LayerParams(**p["layer"])}, feature_layers=feature_layers)
    return bind_head(target, params, np.asarray(stored["vocab_ids"], np.int32), name="eagle")
