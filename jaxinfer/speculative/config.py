"""What an engine speculates with (`SpeculativeConfig`) and what came of it (`SpeculativeStats`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxinfer.speculative.checkpoint import DEFAULT_DRAFT_PATH
from jaxinfer.speculative.drafts.model import DraftModel
from jaxinfer.speculative.eagle import DEFAULT_EAGLE_PATH, EagleHead

METHODS = ("ngram", "self", "draft", "eagle")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine drafts: `EngineConfig(speculative=SpeculativeConfig("ngram", 4))`.

    - "ngram": prompt lookup. The last `ngram_max .. ngram_min` tokens are searched for
      in the request's own tokens and what followed their latest occurrence is proposed
      (deterministic: q is one-hot). Free to compute; strong on text that repeats its input
      (rewrite, fix, extract, edit code: k = 8 pays there). While drafts keep being accepted
      the next ones continue the same match; a fresh match shorter than `ngram_max` proposes
      at most `ngram_short_draft` tokens (None: k), and with `ngram_prompt_first` an
      occurrence in the prompt wins over a later one in the output.
      A step where no slot found a match runs the plain one-token program instead.
    - "self": the target's first `self_layers` layers + final norm + LM head (no new weights).
    - "draft": a `DraftModel` sharing the target's tokenizer, or a path to a checkpoint
      written by `jaxinfer train-draft` (e.g. the shipped `checkpoints/smollm2_draft`).
    - "eagle": a one-layer EAGLE head over the target's own features
      (`jaxinfer.speculative.eagle`): an `EagleHead`, a path written by
      `jaxinfer train-draft --kind eagle`, or None for the shipped `checkpoints/smollm2_eagle`.

    `num_speculative` (k) is fixed per engine: every step verifies up to k drafts per slot.
    `disable_by_batch_size` (vLLM's option of that name): a step with at least this many
    decoding requests runs the plain one-token program instead, because with many rows a
    verify block costs more than the drafts save (on a 2-core CPU every source loses at
    batch 8: BENCHMARKS.md). Only for "ngram" and "self", whose drafts keep no cache of their
    own that a plain step would leave behind.

    A request's first generated token never comes from speculation: it is sampled from
    the logits at the prompt's last token, which the prefill step computes; drafting (and
    verifying) starts from the second token, once the request decodes.
    """

    method: str
    num_speculative: int = 4
    self_layers: int = 4
    draft: DraftModel | EagleHead | str | Path | None = dataclasses.field(default=None, repr=False)
    ngram_max: int = 3
    ngram_min: int = 2
    ngram_short_draft: int | None = 2
    ngram_prompt_first: bool = False
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"SpeculativeConfig.method={self.method!r} must be one of {METHODS}")
        k = self.num_speculative
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:  # (a bool is an int)
            raise ValueError(f"SpeculativeConfig.num_speculative={self.num_speculative!r} must be an integer in [1, 16]")
        if not isinstance(self.ngram_min, int) or not isinstance(self.ngram_max, int) or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min!r}, {self.ngram_max!r}")
        if self.ngram_short_draft is not None and not (isinstance(self.ngram_short_draft, int) and self.ngram_short_draft >= 1):
            raise ValueError(f"SpeculativeConfig.ngram_short_draft={self.ngram_short_draft!r} must be None or an integer >= 1")
        if self.disable_by_batch_size is not None:
            if not (isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size >= 1):
                raise ValueError(f"SpeculativeConfig.disable_by_batch_size={self.disable_by_batch_size!r} must be None "
                                 "or an integer >= 1")
            if self.method not in ("ngram", "self"):
                raise ValueError(f"SpeculativeConfig.disable_by_batch_size works with 'ngram' and 'self' drafts, not "
                                 f"{self.method!r}: its own cache would miss the tokens of the steps that do not speculate")
        if self.method == "draft" and self.draft is None:
            raise ValueError("SpeculativeConfig(method='draft') needs draft=DraftModel(...) or a checkpoint path")
        if self.method in ("ngram", "self") and self.draft is not None:
            raise ValueError(f"SpeculativeConfig(method={self.method!r}) drafts without a model: draft= is for "
                             "'draft' and 'eagle'")

    @classmethod
    def from_vllm(cls, config: dict) -> SpeculativeConfig:
        """vLLM's `speculative_config` dict: `method` ("ngram", "eagle" / "eagle3", "draft_model"),
        `num_speculative_tokens`, `prompt_lookup_max` / `prompt_lookup_min` (n-gram), `model` (the
        draft's or EAGLE head's directory; none: the shipped one), `disable_by_batch_size`.
        Other vLLM keys (a draft's tensor parallelism, quantization, ...) are refused by name."""
        names = {"method": "method", "num_speculative_tokens": "num_speculative", "prompt_lookup_max": "ngram_max",
                 "prompt_lookup_min": "ngram_min", "model": "draft", "disable_by_batch_size": "disable_by_batch_size"}
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict (vLLM's form), got {config!r}")
        unknown = sorted(set(config) - set(names))
        if unknown:
            raise ValueError(f"speculative_config: unsupported keys {unknown} (known: {sorted(names)})")
        fields = {names[key]: value for key, value in config.items() if value is not None}
        method = {"eagle3": "eagle", "draft_model": "draft"}.get(fields.get("method"), fields.get("method"))
        if method is None:
            method = "draft" if "draft" in fields else "ngram" if {"ngram_max", "ngram_min"} & set(fields) else None
        if method is None:
            raise ValueError("speculative_config needs a method ('ngram', 'eagle', 'eagle3', 'draft_model') or a model")
        if method in ("draft", "eagle") and "draft" not in fields:
            fields["draft"] = str(DEFAULT_DRAFT_PATH if method == "draft" else DEFAULT_EAGLE_PATH)
        if method == "ngram" and "ngram_max" in fields and "ngram_min" not in fields:
            fields["ngram_min"] = min(cls.ngram_min, fields["ngram_max"])  # vLLM's min defaults below its max
        return cls(**(fields | {"method": method}))

    @classmethod
    def parse(cls, text: str, num_speculative: int = 4, **options) -> SpeculativeConfig:
        """CLI form: 'ngram', 'self:N', 'draft:PATH' or 'eagle:PATH' ('draft' / 'eagle' alone:
        the shipped checkpoint); `options`: other fields (e.g. disable_by_batch_size)."""
        method, _, arg = text.partition(":")
        if method == "self":
            if arg and not arg.isdigit():
                raise ValueError(f"--speculative {text!r}: 'self:N' takes N, the number of the target's first "
                                 "layers that draft (a positive integer)")
            return cls("self", num_speculative, self_layers=int(arg) if arg else 4, **options)
        if method == "draft":
            return cls("draft", num_speculative, draft=arg or str(DEFAULT_DRAFT_PATH), **options)
        if method in ("eagle", "eagle3"):  # the shipped head is EAGLE-3's (vLLM's name for it)
            return cls("eagle", num_speculative, draft=arg or str(DEFAULT_EAGLE_PATH), **options)
        if method == "ngram" and not arg:
            return cls("ngram", num_speculative, **options)
        raise ValueError(f"--speculative {text!r}: expected 'ngram', 'self:N', 'draft[:PATH]' or 'eagle[:PATH]' "
                         "('eagle3' too)")


@dataclasses.dataclass
class SpeculativeStats:
    """Counts behind acceptance per draft position and tokens per target forward."""

    drafted: np.ndarray  # i64[k]: drafts proposed at position i (verified in the same block)
    accepted: np.ndarray  # i64[k]: of those, accepted (with every draft before them)
    target_calls: int = 0  # decoding rows run through the target
    emitted: int = 0  # tokens those rows emitted

    @classmethod
    def zeros(cls, k: int) -> SpeculativeStats:
        return cls(np.zeros(k, np.int64), np.zeros(k, np.int64))

    def record(self, num_draft: int, num_accepted: int, emitted: int) -> None:
        self.drafted[:num_draft] += 1
        self.accepted[:num_accepted] += 1
        self.target_calls += 1
        self.emitted += emitted

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        """Per position i, the share of drafts proposed there that were accepted, which takes
        drafts 0..i all accepted (vLLM's per-position acceptance; it can only fall with i for
        fixed-length drafts). Conditional on the drafts before it: accepted[i] / accepted[i - 1].
        NaN where nothing was drafted."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return tuple(float(a / d) if d else float("nan") for a, d in zip(self.accepted, self.drafted))

    @property
    def acceptance_rate(self) -> float:
        return float(self.accepted.sum() / max(self.drafted.sum(), 1))

    @property
    def tokens_per_call(self) -> float:
        """Mean tokens emitted per target forward of a decoding row (1.0 without drafts; 0.0 before any)."""
        return self.emitted / max(self.target_calls, 1)

    def summary(self) -> dict[str, float | int | list[float]]:
        """The figures (rounded; None for a position never drafted) with the counts behind them."""
        return {"acceptance_rate": round(self.acceptance_rate, 4),
                "acceptance_per_position": [None if d == 0 else round(a, 4)
                                            for a, d in zip(self.acceptance_per_position, self.drafted)],
                "tokens_per_call": round(self.tokens_per_call, 4), "target_calls": self.target_calls,
                "emitted": self.emitted, "drafted": self.drafted.tolist(), "accepted": self.accepted.tolist()}

    def __repr__(self) -> str:
        return "SpeculativeStats(" + ", ".join(f"{k}={v}" for k, v in self.summary().items()) + ")"
