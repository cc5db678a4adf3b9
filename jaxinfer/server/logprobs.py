"""The OpenAI `logprobs` objects, from the per-token logprobs of a `RequestOutput`.

Completions (legacy)::

    {"tokens": ["Hello", " world"], "token_logprobs": [-0.1, -2.3],
     "top_logprobs": [{"Hello": -0.1, "Hi": -2.5}, ...], "text_offset": [0, 5]}

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

vLLM's `prompt_logprobs` (both): per prompt token, None for the first, then
`{"<token id>": {"logprob", "rank", "decoded_token"}}` for the token and its top alternatives.
A token's text is its bytes decoded on their own: a byte-level piece holding part of a UTF-8
character shows U+FFFD there (chat, whose `bytes` keep the raw bytes) or OpenAI's
"bytes:\\xNN" form (legacy completions, whose `top_logprobs` are keyed by that text).
"""

from __future__ import annotations

import codecs
import itertools

from jaxinfer.engine import RequestOutput
from jaxinfer.sampling import TokenLogprobs
from jaxinfer.tokenizer import Tokenizer


def tokens_of(out: RequestOutput, new_only: bool) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Ids, logprobs and top alternatives of the output's tokens (only those new in it: a stream chunk)."""
    ids = out.delta_token_ids if new_only else out.token_ids
    start = len(out.token_ids) - len(ids)
    return ids, out.logprobs[start:], out.top_logprobs[start:]


def legacy_token(tok: Tokenizer, token_id: int) -> str:
    """A token as the legacy object writes it: its text, or OpenAI's "bytes:\\xe4\\xbd" when its
    bytes are part of a UTF-8 character, so pieces of different characters stay distinct
    `top_logprobs` keys (as U+FFFD they would overwrite each other)."""
    raw = tok.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(tok: Tokenizer, ids: list[int], logprobs: list[float | None],
                        top: list[list[tuple[int, float]] | None], offset: int = 0) -> tuple[dict, int]:
    """-> (the legacy object, the text offset after these tokens); `offset` is where they start.
    Each token's `top_logprobs` holds the token itself too (OpenAI: "up to logprobs + 1
    elements"). None entries (an echoed prompt's first token) stay None. `text_offset` counts
    the characters of the decoded text before each token (a character split over tokens counts
    once, where it completes)."""
    texts = [legacy_token(tok, i) for i in ids]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    starts = list(itertools.accumulate((len(decoder.decode(tok.token_bytes(i))) for i in ids), initial=offset))

    def with_token(text: str, logprob: float, alts: list[tuple[int, float]]) -> dict[str, float]:
        top = {legacy_token(tok, i): v for i, v in alts}
        return top if text in top else top | {text: logprob}

    obj = {"tokens": texts, "token_logprobs": logprobs, "text_offset": starts[:-1],
           "top_logprobs": [None if alts is None else with_token(text, v, alts) for text, v, alts in zip(texts, logprobs, top)]}
    return obj, starts[-1]


def join_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two legacy objects as one (an echoed prompt's, then the generated text's)."""
    if first is None or second is None:
        return second if first is None else first
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tok: Tokenizer, ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]) -> dict:
    return {"content": [_entry(tok, i, v) | {"top_logprobs": [_entry(tok, a, w) for a, w in alts]}
                        for i, v, alts in zip(ids, logprobs, top)]}


def _entry(tok: Tokenizer, token_id: int, logprob: float) -> dict:
    raw = tok.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def vllm_prompt_logprobs(tok: Tokenizer, ids: list[int], scored: TokenLogprobs, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a prompt from its `score_tokens` (one entry per token after
    the first): the token itself first, then its `top` most likely alternatives (ranks from 1)."""
    out: list[dict | None] = [None]
    for token, lp, rank, alt_ids, alt_lps in zip(ids[1:], scored.logprob.tolist(), scored.rank.tolist(),
                                                 scored.top_ids[:, :top].tolist(), scored.top_logprobs[:, :top].tolist()):
        entry = {str(token): {"logprob": lp, "rank": rank, "decoded_token": tok.token_text(token)}}
        for r, (alt, value) in enumerate(zip(alt_ids, alt_lps), 1):
            entry.setdefault(str(alt), {"logprob": value, "rank": r, "decoded_token": tok.token_text(alt)})
        out.append(entry)
    return out
