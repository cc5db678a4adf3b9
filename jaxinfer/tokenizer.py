"""Tokenizer, chat templates and streaming detokenization.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the Rust BPE implementation) and adds
what an inference engine needs on top: which ids are BOS/EOS, whether BOS is prepended, and the
model's jinja chat template. It is built from one of two sources:

- a GGUF file (`Tokenizer.from_gguf`): vocabulary, merges, token types and special ids come from
  llama.cpp's `tokenizer.ggml.*` metadata (`jaxinfer.gguf_tokenizer`); the pre-tokenizer (how
  text is split before BPE) is chosen from `tokenizer.ggml.pre` with the same regexes llama.cpp
  and transformers use.
- a Hugging Face directory (`Tokenizer.from_pretrained_dir`): `tokenizer.json`, plus
  `tokenizer_config.json`, `chat_template.jinja` and `generation_config.json` when present.

Token ids are plain Python `list[int]`; text is `str`. Special tokens written literally in the
input text (e.g. `<|im_start|>`) are matched as special tokens, as in transformers and llama.cpp
(this is how a rendered chat template is tokenized).

Chat templates render in jinja's sandbox (`jaxinfer.chat_template`). `StreamDecoder` turns a stream of generated ids into text deltas that never split a UTF-8
character and that concatenate to `Tokenizer.decode` of all ids.
"""

from __future__ import annotations

import copy
import json
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders

from jaxinfer.chat_template import compile_chat_template, read_chat_template, text_messages
from jaxinfer.gguf_file import GGUFFile, read_gguf
from jaxinfer.gguf_tokenizer import SPM_SPACE, UNICODE_TO_BYTE, backend_from_gguf, bos_eos_processor

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
    def from_gguf(cls, source: str | os.PathLike | GGUFFile) -> Tokenizer:
        """Build from the `tokenizer.*` metadata of a GGUF file, given by path or already read
        (`jaxinfer.gguf_file.read_gguf`); the tensors are not read."""
        gguf = source if isinstance(source, GGUFFile) else read_gguf(source)
        return cls.from_gguf_metadata(gguf.metadata, source=str(gguf.path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "<metadata>") -> Tokenizer:
        """Build from already-decoded GGUF metadata (`GGUFFile.metadata`);
        supported models and pre-tokenizers: `jaxinfer.gguf_tokenizer`."""
        g = backend_from_gguf(meta, source)
        return cls(g.backend, bos_id=g.bos_id, eos_ids=g.eos_ids, chat_template=g.chat_template,
                   add_bos=g.add_bos, add_eos=g.add_eos)


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
            backend.post_processor = bos_eos_processor(
                _token_content(config.get("bos_token")) if add_bos else None, bos_id,
                _token_content(config.get("eos_token")) if add_eos else None, eos_id,
            )
        else:
            empty = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and empty[:1] == [bos_id]
            add_eos = eos_id is not None and empty[-1:] == [eos_id]
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, chat_template=_read_chat_template(d, config),
                   add_bos=add_bos, add_eos=add_eos)

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """The same tokenizer rendering chats with `chat_template`: jinja source, or a file
        holding it, as `--chat-template` takes it (`read_chat_template`, which checks its
        syntax); None: no template. E.g. to give a base model one."""
        other = copy.copy(self)
        other.chat_template = None if chat_template is None else read_chat_template(chat_template)
        other._compiled_template = None
        return other

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
            if all(c in UNICODE_TO_BYTE for c in piece):
                return bytes(UNICODE_TO_BYTE[c] for c in piece)
            return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace(SPM_SPACE, " ").encode("utf-8")

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
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (to be passed to `encode`).

        `messages` is a list of dicts with str `role` and str `content` (or OpenAI's text parts,
        joined; other keys are passed through). Rendering matches transformers' `apply_chat_template(..., tokenize=False)`:
        a sandboxed jinja2 environment with `trim_blocks`/`lstrip_blocks`, the globals
        `raise_exception` and `strftime_now`, a `tojson` filter, and `bos_token`/`eos_token`.
        With `continue_final_message` the text ends right after the last message's content
        (no end-of-turn), so generation continues it (a prefilled assistant answer), as in
        transformers. Extra keyword arguments (e.g. `tools=...`) become template variables.
        OpenAI's `developer` role (its new name for `system`) is rendered as `system` unless
        the template names it (gpt-oss's does: there the two differ).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: continue the last "
                             "message, or open a new assistant turn")
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template; encode a plain prompt instead, or use a model "
                "whose GGUF metadata / tokenizer_config.json has a chat_template"
            )
        messages = text_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        import jinja2

        try:
            as_system = {} if "developer" in self.chat_template else {"developer": "system"}
            text = self._compiled_template.render(
                messages=[dict(m) | {"role": as_system.get(m["role"], m["role"])} for m in messages],
                add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: e.g. a template adding None content to text
            raise ValueError(f"chat template failed to render: {e}") from e
        if continue_final_message:  # as transformers cuts it
            final = messages[-1]["content"]
            if not final.strip() or final.strip() not in text:
                raise ValueError("continue_final_message: the last message's content is empty or the chat template "
                                 "does not render it verbatim")
            at = text.rindex(final.strip())
            kept = final.lstrip()  # its trailing spaces too, where the template kept them
            text = text[: at + (len(kept) if text[at: at + len(kept)] == kept else len(final.strip()))]
        return text


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
