"""Tokenizer, chat templates and streaming detokenization.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the Rust BPE implementation) and adds
what an inference engine needs on top: which ids are BOS/EOS, whether BOS is prepended, and the
model's jinja chat template. It is built from one of two sources:

- a GGUF file (`Tokenizer.from_gguf`): vocabulary, merges, token types and special ids come from
  llama.cpp's `tokenizer.ggml.*` metadata; the pre-tokenizer (how text is split before BPE) is
  chosen from `tokenizer.ggml.pre` with the same regexes llama.cpp and transformers use.
- a Hugging Face directory (`Tokenizer.from_pretrained_dir`): `tokenizer.json`, plus
  `tokenizer_config.json`, `chat_template.jinja` and `generation_config.json` when present.

Token ids are plain Python `list[int]`; text is `str`. Special tokens written literally in the
input text (e.g. `<|im_start|>`) are matched as special tokens, as in transformers and llama.cpp
(this is how a rendered chat template is tokenized).

`StreamDecoder` turns a stream of generated ids into text deltas that never split a UTF-8
character and that concatenate to `Tokenizer.decode` of all ids.
"""

from __future__ import annotations

import json
import operator
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from jaxinfer.gguf_metadata import gguf_metadata

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes (how text is cut into words before BPE), keyed by `tokenizer.ggml.pre`.
# These are the regexes of the models' own tokenizer.json files, which llama.cpp
# (src/llama-vocab.cpp, `llm_tokenizer_bpe`) and transformers (integrations/gguf/
# gguf_tokenizer_mapping.py) reproduce.

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Pre types whose vocabulary was trained on GPT-2's split (ByteLevel's built-in regex,
# `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`).
_GPT2_PRE = frozenset({"gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"})
# The same split after isolating every digit (\p{N}); SmolLM2's tokenizer.json spells this as
# `Digits(individual_digits=True)` followed by ByteLevel.
_DIGITS_GPT2_PRE = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_SPLIT_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
         "lfm2", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
# llama.cpp looks a whole pre-token up in the vocabulary before merging for these
# (`ignore_merges`), as Llama 3's tokenizer.json does.
_IGNORE_MERGES_PRE = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
)
# llama.cpp prepends BOS by default for these (a `tokenizer.ggml.add_bos_token` key overrides);
# for other byte-level vocabularies the default is no BOS. SentencePiece defaults to BOS.
_ADD_BOS_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken"})
SUPPORTED_GGUF_PRE = tuple(sorted(_GPT2_PRE | _DIGITS_GPT2_PRE | set(_SPLIT_PRE)))
SUPPORTED_GGUF_MODELS = ("gpt2", "llama")

_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

# llama.cpp token types (`tokenizer.ggml.token_type`).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

_SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Text <-> token ids for one model. Build with `from_gguf` or `from_pretrained_dir`.

    Attributes:
      backend: the wrapped `tokenizers.Tokenizer` (its post-processor adds BOS/EOS iff the
        model asks for it).
      bos_id: id of the beginning-of-sequence token, or None if the model has none.
      eos_ids: ids that end generation (EOS, end-of-turn, ...), first one is the primary EOS.
      chat_template: the model's jinja chat template source, or None.
      add_bos: whether `encode(..., add_special_tokens=True)` prepends `bos_id`.
      add_eos: whether `encode(..., add_special_tokens=True)` appends `eos_ids[0]` (rare).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        chat_template: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
    ):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.add_eos = add_eos
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._compiled_template = None
        for name, tid in [("bos_id", bos_id), *(("eos_ids", i) for i in self.eos_ids)]:
            if tid is not None and not 0 <= tid < self._vocab_size:
                raise ValueError(f"{name} {tid} is outside the vocabulary (size {self._vocab_size})")

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from the `tokenizer.*` metadata of a GGUF file (the tensors are not read)."""
        return cls.from_gguf_metadata(gguf_metadata(path), source=os.fspath(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "<metadata>") -> Tokenizer:
        """Build from already-decoded GGUF metadata (`jaxinfer.gguf_metadata.gguf_metadata`).

        Supported `tokenizer.ggml.model` values: `gpt2` (byte-level BPE, pre-tokenizer chosen by
        `tokenizer.ggml.pre`) and `llama` (SentencePiece BPE with byte fallback).
        """
        model = meta.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"{source}: no tokenizer metadata (tokenizer.ggml.model / tokens)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(f"{source}: {len(types)=} token types for {len(tokens)=} tokens")
        if model == "gpt2":
            backend = _gguf_byte_level_bpe(meta, tokens, types, source)
            add_bos_default = meta.get("tokenizer.ggml.pre") in _ADD_BOS_PRE
        elif model == "llama":
            backend = _gguf_sentencepiece_bpe(meta, tokens, types, source)
            add_bos_default = True
        else:
            raise ValueError(
                f"{source}: unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; "
                f"supported: {', '.join(SUPPORTED_GGUF_MODELS)}"
            )
        _add_gguf_special_tokens(backend, tokens, types)
        bos_id, eos_ids = _gguf_special_ids(meta, len(tokens), source)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and bool(eos_ids)
        bos = tokens[bos_id] if add_bos else None
        eos = tokens[eos_ids[0]] if add_eos else None
        backend.post_processor = _bos_eos_processor(bos, bos_id, eos, eos_ids[0] if add_eos else None)
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=add_bos, add_eos=add_eos)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from a Hugging Face model directory.

        Reads `tokenizer.json` (required); `tokenizer_config.json` for `bos_token`, `eos_token`,
        `chat_template`; `chat_template.jinja` (preferred over the config's template) or
        `chat_template.json`; and `generation_config.json` for extra EOS ids.

        Whether BOS/EOS are added is decided by tokenizer.json's post-processor, as in
        transformers 5 (which ignores the config's `add_bos_token` when tokenizer.json exists).
        Only when tokenizer.json has no post-processor do `add_bos_token`/`add_eos_token` from
        the config build one (transformers 4 behaviour; v5 would add nothing).
        """
        d = Path(path)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {str(d)!r} (needed to build the tokenizer)")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        config = _read_json(d / "tokenizer_config.json")
        gen_config = _read_json(d / "generation_config.json")

        def tid(name: str) -> int | None:
            token = _token_content(config.get(name))
            if token is None:
                return None
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{str(d)!r}: {name} {token!r} from tokenizer_config.json is not in the vocabulary")
            return token_id

        bos_id, eos_id = tid("bos_token"), tid("eos_token")
        eos_ids = [eos_id] if eos_id is not None else []
        gen_eos = gen_config.get("eos_token_id")
        eos_ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if backend.post_processor is None:
            add_bos = bool(config.get("add_bos_token")) and bos_id is not None
            add_eos = bool(config.get("add_eos_token")) and eos_id is not None
            backend.post_processor = _bos_eos_processor(
                _token_content(config.get("bos_token")) if add_bos else None, bos_id,
                _token_content(config.get("eos_token")) if add_eos else None, eos_id,
            )
        else:
            empty = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and empty[:1] == [bos_id]
            add_eos = eos_id is not None and empty[-1:] == [eos_id]
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, chat_template=_read_chat_template(d, config),
                   add_bos=add_bos, add_eos=add_eos)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json` (and `chat_template.jinja`,
        `generation_config.json`'s `eos_token_id`) so that `from_pretrained_dir` rebuilds an
        equivalent tokenizer. An existing generation_config.json is updated, not replaced."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
        }
        _write_json(d / "tokenizer_config.json", config)
        if self.chat_template is not None:
            (d / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        if self.eos_ids:
            gen = _read_json(d / "generation_config.json")
            gen["eos_token_id"] = list(self.eos_ids) if len(self.eos_ids) > 1 else self.eos_ids[0]
            if self.bos_id is not None:
                gen.setdefault("bos_token_id", self.bos_id)
            _write_json(d / "generation_config.json", gen)

    # --- vocabulary --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids: 1 + the largest id (added tokens included)."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string as spelled in the vocabulary (e.g. "Ġthe"), or None."""
        if not isinstance(token, str):
            raise TypeError(f"token must be str, got {type(token).__name__}")
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary spelling of `token_id` (e.g. "Ġthe"); ValueError if it has none."""
        token_id = self._check_id(token_id)
        token = self.backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} has no entry in the vocabulary")
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprob `bytes`).

        A byte-level BPE piece spells each byte as one character of GPT-2's alphabet and may
        hold part of a UTF-8 character ("…" = b"\\xe2\\x80\\xa6" can be two tokens), so its
        bytes need not decode on their own. SentencePiece pieces use "▁" for a space and
        `<0xXX>` for a fallback byte. Other tokens (special ones) give their text as UTF-8.
        """
        piece = self.id_to_token(token_id)
        if isinstance(self.backend.decoder, decoders.ByteLevel):
            if all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace(_SPM_SPACE, " ").encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """`token_bytes` as text; bytes that are not valid UTF-8 on their own become U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_ids[0]) if self.eos_ids else None

    # --- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, BOS is prepended iff `self.add_bos`.

        Special tokens spelled out in `text` (e.g. "<|im_start|>") always map to their ids.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        _check_unicode(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for each text (tokenized in parallel by the Rust backend)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a sequence of str")
        for t in texts:
            _check_unicode(t)
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (any iterable of ints, e.g. a list or a 1-D integer array)."""
        return self.backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh `StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def _check_id(self, token_id: int) -> int:
        try:
            token_id = operator.index(token_id)
        except TypeError:
            raise TypeError(f"token ids must be integers, got {type(token_id).__name__}") from None
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})")
        return token_id

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"ids must be an iterable of ints, got {type(ids).__name__}")
        if hasattr(ids, "tolist"):  # numpy / jax arrays
            ids = ids.tolist()
        return [self._check_id(i) for i in ids]

    # --- chat template -----------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (to be passed to `encode`).

        `messages` is a list of dicts with str `role` and str `content` (other keys are passed
        through). Rendering matches transformers' `apply_chat_template(..., tokenize=False)`:
        a sandboxed jinja2 environment with `trim_blocks`/`lstrip_blocks`, the globals
        `raise_exception` and `strftime_now`, a `tojson` filter, and `bos_token`/`eos_token`.
        Extra keyword arguments (e.g. `tools=...`) become template variables.
        """
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template; encode a plain prompt instead, or use a model "
                "whose GGUF metadata / tokenizer_config.json has a chat_template"
            )
        _validate_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        import jinja2

        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed to render: {e}") from e


def _check_unicode(text: str) -> None:
    """Raise ValueError if `text` holds a lone surrogate (a Python str may, e.g. decoded from
    the JSON escape "\\ud800"): it is not Unicode text, and the Rust backend would refuse it
    with a TypeError that does not say why."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode: a lone surrogate {text[e.start]!r} at index {e.start}") from None


class StreamDecoder:
    """Incremental detokenizer: push ids one at a time, get back only newly completed text.

    Invariant: `"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)` (with the same
    `skip_special_tokens`). Text whose decoding ends in U+FFFD (an incomplete UTF-8 character
    split across byte-level tokens) is held back until a later token completes it, or until
    `flush()`.

    It decodes a small window, never the whole history, so each `push` costs O(window)::

        ids:      t0 t1 t2 | t3 t4 | t5
                           ^prefix ^read
        prefix_text = decode(ids[prefix:read])   (already emitted)
        text        = decode(ids[prefix:])       delta = text[len(prefix_text):]

    Both decodes start at the same token, so decoder rules that depend on the first token
    (e.g. SentencePiece stripping one leading space) cancel out.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this index have been emitted

    @property
    def ids(self) -> tuple[int, ...]:
        """All ids pushed so far."""
        return tuple(self._ids)

    def push(self, token_id: int) -> str:
        """Add one id; returns the newly completed text (possibly "")."""
        self._ids.append(self._tokenizer._check_id(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self._tokenizer.backend.decode
        window = self._ids[self._prefix :]
        text = decode(window, skip_special_tokens=self._skip)
        if not final and text.endswith(_REPLACEMENT_CHAR):
            return ""
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]


# --- GGUF builders ---------------------------------------------------------------------------


def _gguf_byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int], source: str) -> tokenizers.Tokenizer:
    """Byte-level BPE (`tokenizer.ggml.model = gpt2`): GPT-2, Llama 3, Qwen2, SmolLM, ..."""
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None or pre == "default":
        warnings.warn(f"{source}: no tokenizer.ggml.pre; assuming GPT-2's pre-tokenizer", stacklevel=3)
        pre = "gpt2"
    if pre not in SUPPORTED_GGUF_PRE:
        raise ValueError(
            f"{source}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {', '.join(SUPPORTED_GGUF_PRE)}"
        )
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{source}: byte-level BPE GGUF without tokenizer.ggml.merges")
    vocab = _byte_level_vocab(tokens, types)
    merges = [_split_merge(m, source) for m in meta["tokenizer.ggml.merges"]]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    tok.normalizer = None
    if pre in _GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _gguf_special_ids(meta: Mapping[str, Any], n_tokens: int, source: str) -> tuple[int | None, list[int]]:
    """`(bos_id, eos_ids)` from GGUF metadata; EOS, end-of-turn and end-of-message all stop."""
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta[k] for k in _GGUF_EOS_KEYS if meta.get(k) is not None]
    for key, tid in [("bos_token_id", bos_id), *(("eos_token_id", i) for i in eos_ids)]:
        if tid is not None and not 0 <= tid < n_tokens:
            raise ValueError(f"{source}: tokenizer.ggml.{key}={tid} is outside the {n_tokens} tokens")
    return bos_id, eos_ids


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """`{spelling: id}`. Ordinary tokens not written in the byte alphabet are re-spelled into it
    (transformers does the same); control/user-defined tokens keep their literal text, since
    they are matched literally in the input. On duplicate spellings the last id wins, as in
    llama.cpp's and transformers' lookup tables."""
    alphabet = _byte_to_unicode()
    charset = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (tok, ttype) in enumerate(zip(tokens, types)):
        if ttype not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED) and not set(tok) <= charset:
            tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab[tok] = i
    return vocab


def _gguf_sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int], source: str) -> tokenizers.Tokenizer:
    """SentencePiece BPE (`tokenizer.ggml.model = llama`): Llama 1/2, Mistral v1, TinyLlama, ...

    Pieces use "▁" for spaces; unknown bytes fall back to `<0xXX>` tokens. Merges come from the
    file, or are derived from the piece scores as SentencePiece ranks them (highest score first).
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}  # last id wins on duplicates, as in llama.cpp
    if "tokenizer.ggml.merges" in meta:
        merges = [_split_merge(m, source) for m in meta["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in meta:
        merges = _merges_from_scores(tokens, list(meta["tokenizer.ggml.scores"]), vocab)
    else:
        raise ValueError(f"{source}: SentencePiece GGUF without tokenizer.ggml.scores or merges")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == TOKEN_TYPE_UNKNOWN), None)
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=None if unk_id is None else tokens[unk_id],
                   fuse_unk=True, byte_fallback=True)
    )
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a piece into two pieces that
    are both in the vocabulary, ranked by the merged piece's score (highest first), ties broken
    by the lengths of the halves (longer first), then by vocabulary order (the stable sort keeps
    file order). This is the order transformers' `generate_merges` produces, so both build the
    same tokenizer."""
    if len(scores) != len(tokens):
        raise ValueError(f"{len(scores)=} scores for {len(tokens)=} tokens")
    candidates = [
        (piece[:k], piece[k:], score)
        for piece, score in zip(tokens, scores)
        for k in range(1, len(piece))
        if piece[:k] in vocab and piece[k:] in vocab
    ]
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_gguf_special_tokens(tok: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens (skipped by
    `decode(skip_special_tokens)`); user-defined ones become plain added tokens. All are matched
    whole in input text (as llama.cpp's special-token partitioning does) and keep their ids."""
    special_types = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in special_types]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED]
    size_before = tok.get_vocab_size(with_added_tokens=True)
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    assert tok.get_vocab_size(with_added_tokens=True) == size_before, "added tokens must reuse vocabulary ids"


def _split_merge(merge: str, source: str) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) != 2:
        raise ValueError(f"{source}: malformed merge {merge!r} (expected 'left right')")
    return parts[0], parts[1]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


def _bos_eos_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None):
    """Post-processor adding `bos` before / `eos` after a sequence; None when neither is added."""
    if bos is None and eos is None:
        return None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = single + " " + " ".join([*([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    special = [*([(bos, bos_id)] if bos else []), *([(eos, eos_id)] if eos and eos != bos else [])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# --- pretrained-dir helpers ------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object")
    return data


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as `{"content": ...}`."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(d: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(d / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# --- chat template helpers -------------------------------------------------------------------


def _validate_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] must be a str, got {type(m.get(key)).__name__}")


def _compile_chat_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e
