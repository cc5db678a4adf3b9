"""Batched generation over the paged cache: prefill once, then one jitted decode step per token.

This is the simple static-batch driver behind `jaxinfer generate`: a fixed group of
prompts runs to completion together. Two compiled programs serve every call of the
same shape class: a prefill per prompt-length bucket and one decode step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from jaxinfer.kv import KVCacheSpec, PageAllocator, block_table_array, init_paged_kv
from jaxinfer.loading import Model
from jaxinfer.sampling import SamplingArrays, SamplingParams
from jaxinfer.steps import decode_and_sample, prefill_and_sample


@dataclasses.dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, including a final EOS / stop id if one was hit
    text: str  # generated text, without special tokens and without a matched stop string
    finish_reason: str = ""  # "stop" (EOS, stop id or stop string) or "length"


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0


def prompt_buckets(max_seq_len: int, smallest: int = 16) -> list[int]:
    """Prefill lengths that get compiled: powers of two up to `max_seq_len` (and it)."""
    buckets, n = [], smallest
    while n < max_seq_len:
        buckets.append(n)
        n *= 2
    return buckets + [max_seq_len]


class _Row:
    """Host-side progress of one sequence."""

    def __init__(self, prompt: list[int], params: SamplingParams, model: Model):
        self.prompt, self.params, self.model = prompt, params, model
        self.result = GenerationResult(prompt_token_ids=prompt, token_ids=[], text="")
        self.decoder = model.tokenizer.stream_decoder() if model.tokenizer else None
        self.emitted = 0  # characters of result.text already streamed
        self.hold = max((len(s) for s in params.stop), default=1) - 1  # chars a stop string may still claim
        self.stopped_by_string = False

    @property
    def done(self) -> bool:
        return bool(self.result.finish_reason)

    def push(self, token: int) -> str:
        """Record a token; return the newly final text."""
        r, p = self.result, self.params
        r.token_ids.append(token)
        if (token in self.model.config.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            r.finish_reason = "stop"
        elif self.decoder is not None:
            self._append(self.decoder.push(token))
        if not r.finish_reason and len(r.token_ids) >= p.max_tokens:
            r.finish_reason = "length"
        if self.done and self.decoder is not None:
            self._append(self.decoder.flush())
        end = len(r.text) if self.done else max(self.emitted, len(r.text) - self.hold)
        delta, self.emitted = r.text[self.emitted : end], end
        return delta

    def _append(self, piece: str) -> None:
        """Add decoded text, cutting it at the first stop string (nothing after it counts)."""
        r = self.result
        if self.stopped_by_string:
            return
        r.text += piece
        for stop in self.params.stop:
            cut = r.text.find(stop)
            if cut >= 0:
                r.text, r.finish_reason, self.stopped_by_string = r.text[:cut], "stop", True


class Generator:
    """Generates for up to `max_batch` prompts at once over a paged cache it owns."""

    def __init__(self, model: Model, max_batch: int = 1, max_seq_len: int | None = None,
                 page_size: int = 16, seed: int = 0):
        self.model = model
        max_seq_len = max_seq_len or min(model.config.max_position, 2048)
        self.spec = KVCacheSpec.for_batch(max_batch, max_seq_len, page_size)
        self.allocator = PageAllocator(self.spec.num_pages)
        self.kv = init_paged_kv(model.config, self.spec)
        self.buckets = prompt_buckets(self.spec.max_seq_len)
        self.stats = GenerationStats()
        self._seeds = np.random.default_rng(seed)

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Text (optionally wrapped in the chat template) or token ids -> validated ids."""
        tok = self.model.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            if chat:
                prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
                ids = tok.encode(prompt, add_special_tokens=False)
            else:
                ids = tok.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 chat: bool = False, on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
        """Run all prompts to completion; `on_text(row, delta)` receives text as it is made."""
        rows = self._rows(prompts, params, chat)
        for i, delta in self._run(rows):
            if on_text is not None and delta:
                on_text(i, delta)
        return [r.result for r in rows]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams(), chat: bool = False) -> Iterator[str]:
        """Yield the text of one prompt's continuation piece by piece."""
        for _, delta in self._run(self._rows([prompt], params, chat)):
            if delta:
                yield delta

    def _rows(self, prompts, params, chat) -> list[_Row]:
        if isinstance(prompts, str) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id lists")
        if len(prompts) > self.spec.max_slots:
            raise ValueError(f"{len(prompts)} prompts exceed max_batch={self.spec.max_slots}")
        per_row = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_row) != len(prompts):
            raise ValueError(f"got {len(per_row)} SamplingParams for {len(prompts)} prompts")
        rows = [_Row(self.encode_prompt(p, chat), sp, self.model) for p, sp in zip(prompts, per_row)]
        for i, r in enumerate(rows):
            need = len(r.prompt) + r.params.max_tokens
            if need > self.spec.max_seq_len:
                raise ValueError(f"prompt {i}: {len(r.prompt)} prompt tokens + max_tokens={r.params.max_tokens} "
                                 f"exceed max_seq_len={self.spec.max_seq_len}")
        return rows

    def _run(self, rows: list[_Row]) -> Iterator[tuple[int, str]]:
        b = self.spec.max_slots
        pages = [self.allocator.allocate(-(-(len(r.prompt) + r.params.max_tokens) // self.spec.page_size)) for r in rows]
        try:
            yield from self._decode_loop(rows, pages, b)
        finally:
            for p in pages:
                self.allocator.free(p)

    def _decode_loop(self, rows: list[_Row], pages: list[list[int]], b: int) -> Iterator[tuple[int, str]]:
        cfg, params = self.model.config, self.model.params
        padded = [p.params for p in rows] + [SamplingParams(temperature=0)] * (b - len(rows))
        seeds = [sp.seed if sp.seed is not None else int(self._seeds.integers(2**32)) for sp in padded]
        sampling = SamplingArrays.from_params(padded, seeds)
        self.kv = dataclasses.replace(
            self.kv,
            block_tables=jnp.asarray(block_table_array(pages + [[]] * (b - len(rows)), self.spec.max_pages_per_seq)),
            lengths=jnp.zeros((b,), jnp.int32),
        )
        longest = max(len(r.prompt) for r in rows)
        width = next(n for n in self.buckets if n >= longest)
        tokens = np.zeros((b, width), np.int32)
        num_new = np.zeros((b,), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.prompt)] = r.prompt
            num_new[i] = len(r.prompt)

        start = time.perf_counter()
        next_tokens, self.kv = prefill_and_sample(params, cfg, self.kv, jnp.asarray(tokens), jnp.asarray(num_new), sampling)
        host_tokens = np.asarray(next_tokens)
        self.stats.prompt_tokens += int(num_new.sum())
        self.stats.prompt_seconds += time.perf_counter() - start

        start = time.perf_counter()
        while True:
            for i, r in enumerate(rows):
                if not r.done:
                    yield i, r.push(int(host_tokens[i]))
            active = np.array([not r.done for r in rows] + [False] * (b - len(rows)))
            if not active.any():
                break
            next_tokens, self.kv = decode_and_sample(params, cfg, self.kv, next_tokens, jnp.asarray(active), sampling)
            host_tokens = np.asarray(next_tokens)
            self.stats.decode_tokens += int(active.sum())
        self.stats.decode_seconds += time.perf_counter() - start
