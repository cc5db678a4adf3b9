"""llama.cpp's GGUF tokenizer metadata (`tokenizer.ggml.*`) as a Hugging Face `tokenizers.Tokenizer`.

Vocabulary, merges, token types and special ids come from the metadata; the pre-tokenizer (how
text is split before BPE) is chosen from `tokenizer.ggml.pre` with the same regexes llama.cpp
and transformers use. `jaxinfer.tokenizer.Tokenizer.from_gguf` wraps the result.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

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

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Gemma's GGUF files carry neither a chat template nor an end-of-turn id; like llama.cpp, we
# recognise the vocabulary by its turn markers and supply both. The template is Gemma 3's own
# (google/gemma-3-*-it `chat_template`, text parts only): a system message is prepended to the
# first user turn, and "assistant" is spelled "model".
GEMMA_END_OF_TURN = "<end_of_turn>"
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


class GGUFTokenizer(NamedTuple):
    backend: tokenizers.Tokenizer
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None
    add_bos: bool
    add_eos: bool


def backend_from_gguf(meta: Mapping[str, Any], source: str = "<metadata>") -> GGUFTokenizer:
    """A `tokenizers.Tokenizer` and its special ids from already-decoded GGUF metadata.

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
    backend.post_processor = bos_eos_processor(bos, bos_id, eos, eos_ids[0] if add_eos else None)
    chat_template = meta.get("tokenizer.chat_template")
    if GEMMA_END_OF_TURN in backend.get_vocab() and "<start_of_turn>" in backend.get_vocab():
        eos_ids = list(dict.fromkeys([*eos_ids, backend.token_to_id(GEMMA_END_OF_TURN)]))
        chat_template = chat_template or GEMMA_CHAT_TEMPLATE
    return GGUFTokenizer(backend, bos_id, eos_ids, chat_template, add_bos, add_eos)


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
        replacement=SPM_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
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


UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


def bos_eos_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None):
    """Post-processor adding `bos` before / `eos` after a sequence; None when neither is added."""
    if bos is None and eos is None:
        return None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = single + " " + " ".join([*([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    special = [*([(bos, bos_id)] if bos else []), *([(eos, eos_id)] if eos and eos != bos else [])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
