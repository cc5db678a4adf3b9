"""A request's host-side state: its tokens, progress through the cache, text and metrics."""

from __future__ import annotations

import dataclasses
import enum
import math
import time

from jaxinfer.bad_words import TokenConstraint
from jaxinfer.sampling import SamplingParams, TokenLogprobs
from jaxinfer.speculative.config import SpeculativeStats
from jaxinfer.tokenizer import StreamDecoder, Tokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens the prefix cache spared the model (not recomputed)
    num_preemptions: int = 0
    speculative: SpeculativeStats | None = None  # draft acceptance (engines that speculate)

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival until the scheduler first gave the request a slot."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def mean_inter_token_latency(self) -> float | None:
        if self.num_generated_tokens < 2 or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One sample of a prompt, as vLLM's `RequestOutput.outputs[i]` holds it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of `logprobs` (None without them)
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclasses.dataclass
class RequestOutput:
    """What `Engine.step` reports for a request that made progress. The fields are one
    sample's; `outputs` lists every sample of the prompt (vLLM's view: several from
    `Engine.generate` with `SamplingParams(n > 1)`, whose fields are then sample 0's)."""

    request_id: str
    prompt_token_ids: list[int]
    # all generated ids / text so far (a final EOS / stop id included; special tokens and a
    # matched stop string excluded from the text); with output_kind "delta", only the new ones
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    metrics: RequestMetrics
    # vLLM's: what stopped a "stop" request, the stop string matched or the stop token id
    # (one of `stop_token_ids`); None for EOS, a finished grammar, or any other finish
    stop_reason: str | int | None = None
    # With SamplingParams.logprobs set (else None), one entry per token of `token_ids`: its
    # logprob, and its most likely alternatives as (token id, logprob), most likely first.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With SamplingParams.prompt_logprobs set, the same per token of `prompt_token_ids` (None for
    # the first, which has no context); with output_kind "delta", in the first output only
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    error: str | None = None  # with finish_reason "error": why the engine stopped the request
    prompt: str | None = None  # the prompt's text, when it was given as text
    samples: list[RequestOutput] | None = None  # with n > 1 (`Engine.generate`): the n samples, this one first

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' logprobs (vLLM's): the sample's log-likelihood, given logprobs."""
        return None if self.logprobs is None else math.fsum(self.logprobs)

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(i, o.text, o.token_ids, o.cumulative_logprob, o.logprobs, o.top_logprobs,
                                 o.finish_reason, o.stop_reason) for i, o in enumerate(self.samples or [self])]


class Request:
    """Mutable host-side record of one request.

    `all_tokens = prompt + generated`; the first `num_computed` of them have KV in the
    cache. `pending = len(all_tokens) + num_in_flight - num_computed` tokens still have to go
    through the model: a request with one pending token decodes, one with more prefills a
    chunk. With asynchronous scheduling, `num_in_flight` tokens were sampled by steps already
    dispatched but are not on the host yet; the newest came out of row `in_flight_row` of the
    last dispatched step (a slot, or max_slots + its prefill row).
    """

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int,
                 eos_ids: tuple[int, ...], tokenizer: Tokenizer | None, cache_salt: str | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_text: str | None = None  # the text `prompt` came from, if any (`RequestOutput.prompt`)
        self.params = params
        self.seed = seed
        self.eos_ids = eos_ids
        self.cache_salt = cache_salt
        self.generated: list[int] = []
        wants_logprobs = params.logprobs is not None
        self.logprobs: list[float] | None = [] if wants_logprobs else None  # per generated token
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if wants_logprobs else None
        self.prompt_logprobs: list[float | None] | None = None  # `set_prompt_logprobs`
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.num_computed = 0
        self.num_in_flight = 0
        self.in_flight_row = -1
        self.pages: list[int] = []
        self.num_registered_pages = 0  # leading pages already entered in the prefix cache
        # leading tokens in pages taken from the prefix cache: the pool's layers never write them,
        # though a hybrid model recomputes some for its rings (`Scheduler.hit_recompute`)
        self.num_shared_tokens = 0
        self.slot: int | None = None
        # EAGLE: target features of this many last positions wait in the draft state of the
        # slot (0: none; the slot's release drops them)
        self.draft_carry = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # `RequestOutput.stop_reason`
        self.block_hashes: list[bytes] | None = None  # computed on first admission
        self.metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt))
        self.text = ""
        self._decoder: StreamDecoder | None = tokenizer.stream_decoder(params.skip_special_tokens) if tokenizer else None
        self._emitted_text = 0
        self._emitted_tokens = 0
        self._hold = max((len(s) for s in params.stop), default=1) - 1  # chars a stop string may claim
        self._stopped_by_string = False
        self.ngram_index = None  # NgramIndex over prompt + generated, made by an n-gram speculating engine
        # structured output / bad words: where the output is in its grammar, what it may not write next
        self.matcher: TokenConstraint | None = None

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        """len(all_tokens)."""
        return len(self.prompt) + len(self.generated)

    def token_at(self, i: int) -> int:
        """`all_tokens[i]` without building the list."""
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.generated[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """`all_tokens[start:stop]` (0 <= start <= stop), copying only that slice."""
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.generated[start - n : stop - n]
        return self.prompt[start:] + self.generated[: stop - n]

    @property
    def pending(self) -> int:
        return self.num_tokens + self.num_in_flight - self.num_computed

    @property
    def last_token_in_flight(self) -> bool:
        """Will the tokens in flight take it to max_tokens? (Then no step needs it again.)"""
        return self.num_in_flight > 0 and len(self.generated) + self.num_in_flight >= self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int, now: float, logprob: tuple[float, list[tuple[int, float]]] | None = None) -> None:
        """Record a sampled token (with its logprob and top alternatives when the request
        asked for them) and decide whether the request is done."""
        p = self.params
        self.generated.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob[0])
            self.top_logprobs.append(logprob[1])
        m = self.metrics
        m.num_generated_tokens += 1
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        if self.matcher is not None:
            self.matcher.consume(token)
        if token in self.eos_ids and not p.ignore_eos:
            self.finish_reason = "stop"
        elif token in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        if self._decoder is not None and (self.finish_reason is None or p.include_stop_str_in_output):
            self._append_text(self._decoder.push(token))  # a stop token's text: only if asked for (vLLM's)
        if self.finish_reason is None and self.matcher is not None and self.matcher.done:
            self.finish_reason = "stop"  # the output is complete: its grammar allows nothing more (EOS aside)
        if self.finish_reason is None and len(self.generated) >= p.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and self._decoder is not None:
            self._append_text(self._decoder.flush())

    def _append_text(self, piece: str) -> None:
        """Add decoded text, cutting it at the first stop string (nothing after it counts)
        once min_tokens tokens are out."""
        if self._stopped_by_string or not piece:
            return
        before = len(self.text)
        self.text += piece
        if len(self.generated) < self.params.min_tokens:
            return
        found = [(self.text.find(stop, max(0, before - len(stop) + 1)), stop) for stop in self.params.stop]  # only the tail
        found = [(cut, stop) for cut, stop in found if cut >= 0]  # can hold a new match
        if found:
            cut, stop = min(found, key=lambda match: match[0])
            end = cut + len(stop) if self.params.include_stop_str_in_output else cut
            self.text, self.finish_reason, self._stopped_by_string = self.text[:end], "stop", True
            self.stop_reason = stop

    def set_prompt_logprobs(self, scored: TokenLogprobs) -> None:
        """The prompt's teacher-forced logprobs (`score_tokens`: one per token after the first),
        with `params.prompt_logprobs` alternatives each."""
        n = self.params.prompt_logprobs
        self.prompt_logprobs = [None, *scored.logprob.tolist()]
        self.prompt_top_logprobs = [None, *(list(zip(ids.tolist(), lps.tolist()))[:n]
                                            for ids, lps in zip(scored.top_ids, scored.top_logprobs))]

    def take_output(self) -> RequestOutput | None:
        """The progress since the last call (text held back while a stop string may match),
        shaped by `params.output_kind`; None for a "final_only" request still running."""
        done = self.finish_reason is not None
        kind = self.params.output_kind
        if kind == "final_only" and not done:
            return None
        end = len(self.text) if done else max(self._emitted_text, len(self.text) - self._hold)
        first_token = self._emitted_tokens
        delta_text, self._emitted_text = self.text[self._emitted_text : end], end
        delta_ids, self._emitted_tokens = self.generated[first_token:], len(self.generated)
        if kind == "delta":  # nothing older is copied
            text, token_ids, since = delta_text, delta_ids, first_token
        else:
            text, token_ids, since = self.text[:end], list(self.generated), 0
        prompt_lps, prompt_tops = self.prompt_logprobs, self.prompt_top_logprobs
        if kind == "delta":  # once
            self.prompt_logprobs = self.prompt_top_logprobs = None
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt, token_ids=token_ids,
            text=text, delta_token_ids=delta_ids, delta_text=delta_text, finished=done,
            finish_reason=self.finish_reason, metrics=self.metrics, stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else self.logprobs[since:],
            top_logprobs=None if self.top_logprobs is None else self.top_logprobs[since:],
            prompt_logprobs=prompt_lps, prompt_top_logprobs=prompt_tops, prompt=self.prompt_text,
        )

    def error_output(self, message: str) -> RequestOutput:
        """The last output of a request the engine stopped for `message`: what it had
        emitted, nothing new (computing a delta could be what failed)."""
        emitted = self.generated[: self._emitted_tokens]
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt, token_ids=list(emitted),
            text=self.text[: self._emitted_text], delta_token_ids=[], delta_text="", finished=True,
            finish_reason="error", metrics=self.metrics, error=message, prompt=self.prompt_text,
        )
