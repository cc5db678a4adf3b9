"""Per-layer KV-cache format plans: which storage format each layer's cache uses.

`init_paged_kv(config, spec, kv_cache=...)` (and the engine's `EngineConfig(kv_cache=...)`)
accepts a format name for every layer, a list of names (one per layer), a `KVCachePlan`, or
the path of a plan's JSON file::

    {"kind": "jaxinfer.kv_cache_plan", "version": 1,
     "formats": ["int8", "int4", ...],          # one per layer
     "page_size": 16, "budget_kl": 0.01, "calibration_kl": 0.0071, "model": "SmolLM2-..."}

Only `formats` is required; the rest records how the plan was made.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

from jaxinfer.kv.formats import DENSE_FORMAT_OF_DTYPE, FORMAT_NAMES, FORMATS, get_format

PLAN_KIND = "jaxinfer.kv_cache_plan"
PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """One format name per layer, plus a record of the calibration that chose them. Hashable."""

    formats: tuple[str, ...]
    page_size: int | None = None  # page size the plan was calibrated at
    budget_kl: float | None = None  # the budget it was chosen for (mean next-token KL, nats)
    budget_out_err: float | None = None  # or: max relative attention-output error per layer and head
    calibration_kl: float | None = None  # mean KL measured on the calibration text
    model: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.formats, str) or not isinstance(self.formats, (tuple, list)) or not self.formats:
            raise ValueError(f"a KV-cache plan needs a non-empty list of per-layer formats, got {self.formats!r}")
        object.__setattr__(self, "formats", tuple(self.formats))
        for i, name in enumerate(self.formats):
            if name not in FORMATS:
                raise ValueError(f"KV-cache plan layer {i}: unknown format {name!r}; valid formats: {', '.join(FORMAT_NAMES)}")
        if self.page_size is not None and not (_is_int(self.page_size) and self.page_size > 0):
            raise ValueError(f"KV-cache plan page_size={self.page_size!r} must be a positive integer")
        for name in ("budget_kl", "budget_out_err", "calibration_kl"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"KV-cache plan {name}={value!r} must be a number >= 0")
        if not isinstance(self.model, str):
            raise ValueError(f"KV-cache plan model={self.model!r} must be a string (the model's name)")

    @property
    def n_layers(self) -> int:
        return len(self.formats)

    def bytes_per_token(self, n_kv_heads: int, head_dim: int, page_size: int) -> float:
        """Bytes one cached token takes across all layers, scales included."""
        return sum(get_format(f).bytes_per_token(n_kv_heads, head_dim, page_size) for f in self.formats)

    def to_json(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "")}
        return json.dumps({"kind": PLAN_KIND, "version": PLAN_VERSION, **fields, "formats": list(self.formats)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> KVCachePlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"KV-cache plan is not valid JSON: {e}") from None
        if not isinstance(data, dict) or "formats" not in data:
            raise ValueError("KV-cache plan JSON must be an object with a 'formats' list")
        if data.get("kind", PLAN_KIND) != PLAN_KIND or data.get("version", PLAN_VERSION) != PLAN_VERSION:
            raise ValueError(f"not a version-{PLAN_VERSION} KV-cache plan: kind={data.get('kind')!r}, version={data.get('version')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"kind", "version"})
        if unknown:
            raise ValueError(f"KV-cache plan has unknown fields {unknown}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> KVCachePlan:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"KV-cache plan file {str(path)!r} does not exist")
        return cls.from_json(path.read_text())


KVCacheArg = str | os.PathLike | KVCachePlan | Sequence[str]

# other names of formats: vLLM's `--kv-cache-dtype` values and dtype names
FORMAT_ALIASES = {"fp8": "fp8_e4m3", "bfloat16": "bf16", "float32": "f32"}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def kv_cache_choice(kv_cache: KVCacheArg, page_size: int | None = None) -> KVCachePlan | str:
    """`kv_cache` checked: a `KVCachePlan` (given, as a list of per-layer format names, or
    read from its JSON file) or a format name ("auto", one of `FORMAT_NAMES`, or vLLM's
    spelling in `FORMAT_ALIASES`). A plan with KIVI layers (int4 / int2: a key scale per
    channel per page) holds its error budget only at the page size it was calibrated at:
    another `page_size` is refused."""
    if isinstance(kv_cache, str):
        kv_cache = FORMAT_ALIASES.get(kv_cache, kv_cache)
    if isinstance(kv_cache, KVCachePlan):
        plan = kv_cache
    elif isinstance(kv_cache, (list, tuple)):
        plan = KVCachePlan(formats=kv_cache)
    elif kv_cache == "auto" or (isinstance(kv_cache, str) and kv_cache in FORMATS):
        return kv_cache
    elif isinstance(kv_cache, os.PathLike) or (isinstance(kv_cache, str) and (kv_cache.endswith(".json")
                                                                              or Path(kv_cache).is_file())):
        plan = KVCachePlan.load(kv_cache)
    else:
        raise ValueError(f"unknown kv_cache={str(kv_cache)[:200]!r}: use 'auto', a format name "
                         f"({', '.join(FORMAT_NAMES)}), a list of them (one per layer), a KVCachePlan or the path of "
                         "a plan's JSON file")
    per_page = sorted({f for f in plan.formats if get_format(f).has_tail})
    if per_page and None not in (page_size, plan.page_size) and page_size != plan.page_size:
        raise ValueError(f"KV-cache plan was calibrated at page_size={plan.page_size} and its {per_page} layers quantize "
                         f"keys per page, so its error budget does not hold at page_size={page_size}: run it at "
                         f"page_size={plan.page_size}, or calibrate one for {page_size} (`jaxinfer calibrate-kv "
                         f"--page-size {page_size}`)")
    return plan


def resolve_kv_cache(kv_cache: KVCacheArg, n_layers: int, dtype: str, page_size: int | None = None) -> tuple[str, ...]:
    """`kv_cache` -> one format name per layer (`kv_cache_choice` checks it).

    "auto" is the dense format of `dtype` (the model's own precision); a format name applies
    to every layer; a `KVCachePlan` or a path to its JSON file gives each layer its own.
    """
    choice = kv_cache_choice(kv_cache, page_size)
    if isinstance(choice, str):
        return ((DENSE_FORMAT_OF_DTYPE[str(dtype)] if choice == "auto" else choice),) * n_layers
    if choice.n_layers != n_layers:
        raise ValueError(f"KV-cache plan has {choice.n_layers} layers but the model has {n_layers}")
    return choice.formats
