"""Structured output: sampling only what a JSON schema, regex, choice list or grammar allows.

A request asks with `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`
(vLLM's names; the server maps OpenAI's `response_format` onto it). Grammars are compiled and
followed on the host by llguidance (the constrained-decoding library vLLM and llama.cpp use):

- `GrammarCompiler`: llguidance's view of a tokenizer's vocabulary (built once per engine, ~1 s)
  and a checked `GrammarMatcher` per request; a bad schema or grammar raises ValueError at
  `add_request`, naming the problem;
- `GrammarMatcher`: one request's place in its grammar. Before a step samples the request's
  next token the host asks it for the tokens the grammar allows (`allowed`: a packed bitmask,
  V / 8 bytes), after the step it consumes the token sampled (`consume`). The request ends
  ("stop") when the grammar can go no further.

On the device a step only applies the bitmask (`mask_logits`): disallowed tokens' logits
become -inf, after the penalties and before temperature and the top-k / top-p / min-p filters,
so a constrained request samples from the model's distribution renormalized over what the
grammar allows. Logprobs stay those of the raw logits, as with penalties.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.tokenizer import Tokenizer

BITS = 32  # tokens per word of a packed bitmask (i32; bit t % 32 of word t // 32 is token t)
MAX_CHOICES = 1024


def bitmask_words(vocab: int) -> int:
    """Words of a packed bitmask over `vocab` tokens."""
    return -(-vocab // BITS)


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether the packed bitmask i32[W] allows `token`."""
    return bool(mask.view(np.uint32)[int(token) // BITS] >> np.uint32(int(token) % BITS) & 1)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `StructuredOutputsParams`): exactly one of

    - `json`: a JSON schema (a dict, or its JSON text);
    - `json_object`: True = any JSON object (OpenAI's `response_format: {"type": "json_object"}`);
    - `regex`: a regular expression (Rust `regex` syntax) the whole output matches;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a context-free grammar, in llguidance's Lark dialect or llama.cpp's GBNF.

    JSON may hold any whitespace between its tokens (as in vLLM) unless `disable_any_whitespace`:
    then it is compact (`{"a":1,"b":[2,3]}`), which keeps a small model from rambling in
    whitespace. An object that declares `properties` and leaves `additionalProperties` unset
    admits only those (`disable_additional_properties`, vLLM's field; on by default, as vLLM's
    default xgrammar backend compiles schemas): a small model given an open object keeps
    inventing keys. False follows JSON Schema (undeclared keys allowed). A schema keyword the
    grammar cannot enforce (`uniqueItems`, `not`, `if`, ...: llguidance's list) is a ValueError
    naming it, unless `ignore_unsupported_keywords` (llguidance's lenient mode): then it is
    not enforced (the server's choice for OpenAI's non-strict schemas, which are best effort).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True
    ignore_unsupported_keywords: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties",
                     "ignore_unsupported_keywords"):
            _check(isinstance(getattr(self, name), bool), f"structured_outputs.{name}={getattr(self, name)!r} must be a bool")
        _check(len(given) == 1, "structured_outputs must set exactly one of json, json_object, regex, choice, "
               f"grammar (got {given or 'none'})")
        if self.json is not None:
            _check(isinstance(self.json, (str, dict)) or self.json is True,
                   "structured_outputs.json must be a JSON schema (an object, its JSON text, or True for any JSON "
                   f"value), got {self.json!r}"[:300])
            try:
                text = self.json if isinstance(self.json, str) else json.dumps(self.json)
                schema = json.loads(text)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            _check(isinstance(schema, dict) or schema is True,
                   "structured_outputs.json must be a JSON schema (an object, or true for any JSON value)")
            # frozen: the text, never a dict a caller could change (the schema `true` is `{}`, any value)
            object.__setattr__(self, "json", "{}" if schema is True else text)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""),
                   f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else (self.choice,)
            _check(0 < len(choice) <= MAX_CHOICES and all(isinstance(c, str) and c for c in choice),
                   f"structured_outputs.choice must be 1 to {MAX_CHOICES} non-empty strings, got {str(self.choice)[:200]}")
            object.__setattr__(self, "choice", choice)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From its JSON form (`{"json": {...}}`), unknown fields refused by name."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        _check(not unknown, f"structured_outputs: unknown fields {unknown}")
        return cls(**fields)

    def grammar_text(self) -> str:
        """The llguidance grammar this asks for, checked (ValueError naming what is wrong)."""
        import llguidance

        try:
            if self.json is not None or self.json_object:
                options = {"whitespace_flexible": not self.disable_any_whitespace,
                           "lenient": self.ignore_unsupported_keywords}
                schema = self.json or '{"type": "object"}'
                if self.disable_additional_properties:
                    schema = json.dumps(strict_schema(json.loads(schema), declared_only=True))
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, options)
            elif self.regex is not None:
                grammar = llguidance.grammar_from("regex", ascii_digits(self.regex))
            elif self.choice is not None:
                grammar = llguidance.grammar_from("choice", list(self.choice))
            else:
                grammar = llguidance.grammar_from("grammar", self.grammar)
            error = llguidance.LLMatcher.validate_grammar(grammar)
        except ValueError as e:
            error = str(e)
        if error:
            raise ValueError(f"structured_outputs.{self.kind}: {error}")
        return grammar

    @property
    def kind(self) -> str:
        """The field that is set."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


def ascii_digits(regex: str) -> str:
    """`regex` with `\\d` meaning [0-9], as in JSON Schema's patterns and vLLM's default backend
    (Rust's `regex` reads it as any Unicode digit, and a small model then favours the rare
    digits its byte tokens spell); `\\p{Nd}` still asks for those."""
    out, depth, i = [], 0, 0  # depth: nesting of character classes (Rust's may nest)
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            out.append(("0-9" if depth else "[0-9]") if escaped == "d" else c + escaped)
            i += 2
            continue
        if c == "[":
            depth += 1
            out.append(c)
            i += 1
            for opener in ("^", "]"):  # a leading "]" (after an optional "^") is a literal
                if regex.startswith(opener, i):
                    out.append(opener)
                    i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def strict_schema(schema: Any, declared_only: bool = False) -> Any:
    """OpenAI's strict mode (`"strict": true` on a function or a response format): every object
    admits only the properties it declares unless it says otherwise (`additionalProperties`
    unset reads as false). `declared_only`: only objects that declare `properties` are closed
    (`{"type": "object"}` alone stays any object). The schema is copied, not changed."""
    if isinstance(schema, list):
        return [strict_schema(s, declared_only) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: strict_schema(value, declared_only) if key in _SUBSCHEMAS else value for key, value in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(closed.get(key), dict):
            closed[key] = {name: strict_schema(sub, declared_only) for name, sub in closed[key].items()}
    types = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    is_object = "properties" in schema if declared_only else ("object" in types or "properties" in schema)
    if is_object and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


# keywords whose value is a schema or a list of schemas
_SUBSCHEMAS = frozenset({"items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties", "if", "then",
                         "else", "contains"})


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class GrammarMatcher:
    """One request's place in its grammar (an `llguidance.LLMatcher`)."""

    def __init__(self, matcher: Any, words: int) -> None:
        self._matcher = matcher
        self.words = words

    def allowed(self) -> np.ndarray:
        """i32[W]: the packed bitmask of the tokens the grammar allows next."""
        mask = np.frombuffer(self._matcher.compute_bitmask(), np.int32)
        return mask[: self.words]

    def consume(self, token: int) -> None:
        """Advance past a sampled token; ValueError if the grammar did not allow it (only a
        token the mask did not cover can be: a bug, or a row whose every token was masked)."""
        if not self._matcher.consume_token(token):
            raise ValueError(f"token {token} does not continue the structured output: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (or ended at EOS)."""
        return self._matcher.is_stopped()

    def draft_masks(self, drafts: Sequence[int]) -> np.ndarray:
        """The masks after each of the first drafts the grammar allows -> i32[n, W]: row j is
        what may follow drafts[: j + 1]; n <= len(drafts) stops before the first draft the
        grammar refuses (verifying it could only reject it) and after one that completes the
        grammar (the request ends there: what follows it is never kept, so any mask does).
        The matcher is left where it was (the drafts are tentative)."""
        masks = []
        valid = 0 if self._matcher.is_stopped() else self._matcher.validate_tokens([int(t) for t in drafts])
        for token in drafts[:valid]:  # (consuming a refused token would leave the matcher in error)
            if not self._matcher.consume_token(int(token)):
                break
            if self._matcher.is_stopped():
                masks.append(np.full(self.words, -1, np.int32))
                break
            masks.append(self.allowed())
        self._matcher.rollback(len(masks))
        return np.stack(masks) if masks else np.zeros((0, self.words), np.int32)


class AfterThinking:
    """A grammar that starts when a reasoning model's thinking is over (vLLM's structured
    output under a reasoning parser: `jaxinfer.reasoning`). The same methods as
    `GrammarMatcher`, through three states:

    - "thinking": every token is allowed until the output ends with `end` (the ids of
      `</think>`); then the answer starts;
    - "lead": the first token either opens a thinking (`opener`, the one token of `<think>`:
      a tokenizer that spells it in several tokens cannot open one under a grammar) or starts
      the answer (any token the grammar allows);
    - "answer": the grammar's.
    """

    def __init__(self, grammar: GrammarMatcher, state: str, end: Sequence[int], opener: int | None = None) -> None:
        if state not in ("thinking", "lead", "answer") or (state == "lead" and opener is None):
            raise ValueError(f"AfterThinking: state {state!r} (opener {opener})")
        self.grammar, self.state = grammar, state
        self._end, self._opener = tuple(end), opener
        self._tail: tuple[int, ...] = ()  # thinking: its last len(end) tokens
        self._free = np.full(grammar.words, -1, np.int32)  # i32[W]: the thinking's mask, every token

    def allowed(self) -> np.ndarray:
        """i32[W]: the tokens allowed next."""
        if self.state == "thinking":
            return self._free
        mask = self.grammar.allowed()
        if self.state == "lead":
            mask = mask.copy()
            mask.view(np.uint32)[self._opener // BITS] |= np.uint32(1 << self._opener % BITS)
        return mask

    def consume(self, token: int) -> None:
        self.state, self._tail, answers = self._next(self.state, self._tail, token)
        if answers:
            self.grammar.consume(token)

    @property
    def done(self) -> bool:
        return self.state == "answer" and self.grammar.done

    def draft_masks(self, drafts: Sequence[int]) -> np.ndarray:
        """`GrammarMatcher.draft_masks`, through the thinking: free while it lasts, the
        grammar's from the token that ends it."""
        state, tail, masks = self.state, self._tail, [np.zeros((0, self.grammar.words), np.int32)]
        for j, token in enumerate(drafts):
            if state == "answer" or (state == "lead" and token != self._opener):  # the grammar's from here
                masks.append(self.grammar.draft_masks(drafts[j:]))
                break
            state, tail, _ = self._next(state, tail, token)
            masks.append((self._free if state == "thinking" else self.grammar.allowed())[None])
        return np.concatenate(masks)

    def _next(self, state: str, tail: tuple[int, ...], token: int) -> tuple[str, tuple[int, ...], bool]:
        """(state, tail) after `token`, and whether the grammar takes it (it is the answer's)."""
        if state == "answer":
            return state, tail, True
        if state == "lead":
            return ("thinking", (), False) if token == self._opener else ("answer", (), True)
        tail = (*tail, int(token))[-len(self._end):]
        return ("answer", (), False) if tail == self._end else ("thinking", tail, False)


class GrammarCompiler:
    """Compiles requests' grammars against one tokenizer, keeping the newest `capacity`
    compiled (agents send the same tool schema again and again; a deep JSON schema takes
    seconds). Thread-safe, and llguidance lets go of the GIL while it compiles, so a server
    compiles off the engine's thread (`Engine.compile_grammar`).

    `vocab_size`: the model's vocabulary (rows of its logits; ids past the tokenizer's are
    never allowed); `eos_ids`: the tokens that end a complete output."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int], capacity: int = 256) -> None:
        import llguidance

        self._llguidance = llguidance
        self._tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                 eos_token=list(eos_ids) or None)
        self.words = bitmask_words(vocab_size)
        self.capacity = capacity
        self._compiled: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()  # unstarted llguidance matchers
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for `params` (ValueError naming what is wrong with it)."""
        with self._lock:
            compiled = self._compiled.get(params)
            if compiled is not None:
                self._compiled.move_to_end(params)
        if compiled is None:
            compiled = self._llguidance.LLMatcher(self._tokenizer, params.grammar_text(), log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{params.kind}: {compiled.get_error()}")
            with self._lock:
                self._compiled[params] = compiled
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        return GrammarMatcher(compiled.deep_copy(), self.words)


def allow_all(rows: int | tuple[int, ...], vocab: int) -> np.ndarray:
    """i32[*rows, W]: bitmasks allowing every token (rows without a grammar)."""
    return np.full((*np.atleast_1d(rows), bitmask_words(vocab)), -1, np.int32)


def mask_logits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits f32[..., V], allowed i32[..., W] (packed: bit t % 32 of word t // 32 allows
    token t) -> f32[..., V] with every token its row does not allow at -inf."""
    v = logits.shape[-1]
    bits = (allowed[..., None] >> jnp.arange(BITS, dtype=jnp.int32)) & 1  # i32[..., W, 32]
    keep = bits.reshape(*allowed.shape[:-1], -1)[..., :v].astype(bool)
    return jnp.where(keep, logits, -jnp.inf)
