"""`Engine`: continuous batching over a fixed-shape paged cache, driven from the host.

    engine = Engine(model, EngineConfig(max_slots=8))
    engine.add_request("Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.request_id, out.delta_text)

Each `step()` asks the `Scheduler` what to run, packs it into a fixed-shape `StepBatch`
(numpy on the host), runs the jitted `engine_step`, and hands the sampled tokens back to
the requests. The block tables stay on the device; each step sends only the entries the
scheduler changed (`jaxinfer.kv.table_updates`). Bad input raises at `add_request` and
never disturbs running requests; a step that fails anyway finishes only the request(s) that
caused it, with finish_reason "error" (see `step`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding
from jaxinfer.attention.dispatch import kernel_names, kernels_by_default, require_reference
from jaxinfer.bad_words import AllOf, BadWords, bad_word_ids
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import EngineConfig, EngineMetrics
from jaxinfer.engine.multihost import StepChannel, spans_processes
from jaxinfer.engine.request import Request, RequestMetrics, RequestOutput
from jaxinfer.engine.scheduler import SchedulePlan, Scheduler
from jaxinfer.kv import KVCacheSpec, init_paged_kv
from jaxinfer.kv.kivi import KiviLayerKV
from jaxinfer.kv.pages import NULL_PAGE
from jaxinfer.kv.prefix_cache import cache_identity
from jaxinfer.kv.streaming import StreamingSpec
from jaxinfer.kv.table_updates import TableMirror, TableUpdates, apply_table_updates, updates_size
from jaxinfer.kv.window_ring import hit_recompute, ring_pages
from jaxinfer.layer_stack import LayerStack, entry_pytrees
from jaxinfer.loading import Model
from jaxinfer.model.params import with_gemm_weights
from jaxinfer.model.row_layouts import choose_reads
from jaxinfer.model.stacking import layer_runs, resolve_layer_loop, resolve_weight_layouts, with_layer_runs
from jaxinfer.penalties import PenaltyState, init_penalty_state, set_slot, slot_history
from jaxinfer.programs import BackgroundCompiler, CompileCounter, use_persistent_cache
from jaxinfer.reasoning import ReasoningParser, find_reasoning_parser
from jaxinfer.sampling import SamplingArrays, SamplingParams, TokenLogprobs, truncate_prompt
from jaxinfer.scoring import score_tokens
from jaxinfer.speculative.checkpoint import load_trained_draft
from jaxinfer.speculative.config import SpeculativeConfig, SpeculativeStats
from jaxinfer.speculative.drafts import DraftModel, check_draft_compatible, self_draft
from jaxinfer.speculative.drafts.ngram import NgramIndex
from jaxinfer.speculative.eagle import DEFAULT_EAGLE_PATH, EagleHead, load_eagle_head
from jaxinfer.speculative.eagle.step import EagleBatch, EagleState, eagle_step
from jaxinfer.speculative.step import DraftBatch, speculative_step
from jaxinfer.step import PrefillBatch, StepBatch, engine_step, feed_decode_tokens, step_logits, step_logprobs
from jaxinfer.structured_output import (AfterThinking, GrammarCompiler, GrammarMatcher, StructuredOutputsParams,
                                       allow_all, allows)
from jaxinfer.tokenizer import Tokenizer


logger = logging.getLogger(__name__)

STREAMING_MAX_LEN = 2**31 - 1  # a streaming sequence is bounded only by int32 lengths

# A request's prompt: a text, token ids, a conversation (message dicts for the chat template), or
# vLLM's prompt dicts, {"prompt": text} and {"prompt_token_ids": ids}
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]] | Mapping[str, Any]
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")

# A step program: (context bucket width, with a prefill group, draft block width (0 = the plain
# step), decode rows, with penalties)
ProgramKey = tuple[int, bool, int, int, bool]


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched to the device (`Engine._launch`)."""

    plan: SchedulePlan
    drafts: DraftBatch | EagleBatch | None
    index: int  # the engine's step count when it was dispatched
    outputs: tuple  # on the device: see `Engine._dispatch`
    slots: list[int]  # of plan.decode's requests
    rows: list[int]  # their rows in the step's decode logits (`step_logprobs`)
    # (request, prefill row) of the chunks that ended a prompt (`_first_tokens`), set after commit
    first_tokens: list[tuple[Request, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepResult:
    """A step's tokens on the host (`Engine._collect`)."""

    tokens: np.ndarray  # i32[B, k + 1]: slot b emits tokens[b, : accepted[b] + 1]
    accepted: np.ndarray  # i32[B]
    prefill: np.ndarray | None  # i32[P]: the token after each prefill row's chunk
    step_logits: tuple  # on the device, for `_logprobs`


class Engine:
    def __init__(self, model: Model, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        mc = model.config
        stream = None if config.streaming is None else StreamingSpec(*config.streaming)
        if stream is not None:  # a variant with no kernel: say so now, not at the first step's trace
            require_reference(config.attention_impl, "StreamingLLM ring attention")
        max_len = config.max_model_len or (STREAMING_MAX_LEN if stream else min(mc.max_position, 2048))
        if max_len > mc.max_position and stream is None:
            raise ValueError(f"max_model_len={max_len} exceeds the model's context {mc.max_position}")
        pages_per_seq = stream.pages_for(config.page_size) if stream else -(-max_len // config.page_size)
        # a mesh's data replicas each own max_slots / D slots and num_pages / D pages
        if config.mesh is not None:
            sharding.check_mesh(config.mesh, mc, config.max_slots)
        data = 1 if config.mesh is None else config.mesh.shape["data"]
        num_pages = config.num_pages or data * (config.max_slots // data * pages_per_seq + 1)
        if num_pages % data:
            raise ValueError(f"num_pages={num_pages} is not divisible by the mesh's data={data} axis "
                             f"(each data replica holds num_pages / {data} pages)")
        self.max_model_len = max_len
        self.spec = KVCacheSpec(num_pages=num_pages, page_size=config.page_size,
                                max_slots=config.max_slots, max_pages_per_seq=pages_per_seq)
        self.compilation_cache = use_persistent_cache(config.compilation_cache)
        sc = config.speculative  # scanned: params and cache stacked in runs; a self-draft's layers end one,
        # as does each layer an EAGLE-3 head taps
        eagle = self._eagle_head(sc) if sc and sc.method == "eagle" else None
        split_at = (sc.self_layers,) if sc and sc.method == "self" else ()
        if eagle is not None:
            split_at = tuple(i + 1 for i in eagle.feature_layers if i + 1 < mc.n_layers)
        runs = layer_runs(mc, config.kv_cache, split_at) if resolve_layer_loop(config.layer_loop) == "scan" else None
        params = with_layer_runs(model.params, runs)
        self.row_layouts: tuple[str, str] | None = None  # what 1 and 2-6 rows read, with all weight layouts
        if resolve_weight_layouts(config.weight_layouts, params, config.mesh) == "all":
            params = with_gemm_weights(params)
            self.row_layouts = choose_reads(params, config.row_layouts)
            params = with_gemm_weights(params, self.row_layouts)
        self.model = model = dataclasses.replace(model, params=params)
        max_chunk = max(config.prefill_chunk, 1 + (sc.num_speculative if sc else 0))
        # hybrid models: windowed layers in a bounded ring per slot (`jaxinfer.kv.window_ring`), on a mesh
        # each data replica's slots' rings on its devices
        self.window_ring = None if stream else window_ring(mc, config.page_size, max_chunk, pages_per_seq)
        self.kv = self._commit(init_paged_kv(mc, self.spec, streaming=stream, kv_cache=config.kv_cache,
                                             kv_head_copies=sharding.kv_head_copies(mc.n_kv_heads, config.mesh),
                                             layer_runs=runs, window_ring=self.window_ring, window_replicas=data))
        self._step, self._spec_step = engine_step, speculative_step
        self._compiles = CompileCounter()  # `compiled_programs`: this engine's programs only
        self._compiler: BackgroundCompiler | None = None  # `start_warmup`
        self._ran: set[ProgramKey] = set()  # programs this engine has run
        # programs whose attention kernel failed to compile on this device: they run the reference
        self._fallbacks: dict[ProgramKey, str] = {}  # key -> the kernel that failed
        self._warned: set[str] = set()  # kernels a fallback warning named already
        self._compiled: set[ProgramKey] = set()  # programs `_compile` compiled (kernels or their fallback)
        self._warm_logprobs = False  # `_compile` also compiles the logprob program of each step's outputs
        self._logprob_shapes: set[tuple] = set()  # the step-output shapes it was compiled for
        self._place, self._place_drafts = (lambda batch: batch), (lambda drafts: drafts)
        # the device's block tables, kept equal to the scheduler's page lists by the entries that change
        self._tables = TableMirror(config.max_slots, pages_per_seq, updates_size(config.max_slots, config.page_size,
                                                                                 max_chunk))
        self._apply_tables, self._place_updates = apply_table_updates, (lambda updates: updates)
        if config.mesh is not None:
            self.model, self.kv, self._step, self._place = sharding.shard_engine(model, self.kv, config.mesh,
                                                                                 config.max_slots, engine_step)
            self._apply_tables, self._place_updates = sharding.shard_table_updates(config.mesh, apply_table_updates)
        self._init_speculation(config.speculative, eagle)  # after sharding: a self-draft shares the sharded params
        if config.mesh is not None and config.speculative is not None:
            self.draft, self.draft_kv, self._draft_vocab, self._spec_step = sharding.shard_speculation(
                config.mesh, self.model.params, self.kv, self.draft, self.draft_kv, self._draft_vocab, speculative_step)
            self._place_drafts = lambda drafts: sharding.place_slots(drafts, config.mesh)
        k = config.speculative.num_speculative if config.speculative else 0
        # KIVI formats write whole pages from their tails whatever the write indices say, so they
        # would rewrite shared pages while a ring model recomputes a prefix hit's last tokens
        kivi = any(isinstance(layer, KiviLayerKV) for layer in entry_pytrees(self.kv.layers))
        self.scheduler = Scheduler(
            max_slots=config.max_slots, page_size=config.page_size, num_pages=num_pages,
            prefill_chunk=config.prefill_chunk, max_prefill_rows=config.max_prefill_rows,
            max_tokens_per_step=config.max_tokens_per_step,
            enable_prefix_caching=config.enable_prefix_caching and stream is None and not (self.window_ring and kivi),
            # a hit's last tokens are recomputed so the windowed layers' rings receive their keys
            hit_recompute=hit_recompute([mc.window(i) for i in range(mc.n_layers)]) if self.window_ring else 0,
            cache_root=cache_identity(mc, repr(config.kv_cache), str(jax.tree.leaves(self.kv.layers[0])[0].dtype),
                                      config.page_size),
            static_batching=config.scheduling == "static",
            release_window=None if stream else release_window(mc),
            max_pages_per_seq=pages_per_seq if stream else None,
            num_speculative=k, data_parallel=data,
        )
        pool_tokens = self.scheduler.max_request_pages * config.page_size
        if stream is None and self.scheduler.release_window is None and pool_tokens < max_len:
            # vLLM refuses to start here; cut, a small pool (a notebook's, a test's) still serves, and
            # a server's default max_tokens ("the rest of the context") fits the pool
            logger.warning("num_pages=%d holds at most %d tokens per request, below max_model_len=%d: max_model_len "
                           "is cut to %d (leave num_pages unset, or raise it, for the whole context)",
                           num_pages, pool_tokens, max_len, pool_tokens)
            self.max_model_len = pool_tokens
        self.context_buckets = context_buckets(pages_per_seq, -(-config.min_context_bucket // config.page_size))
        self.decode_row_buckets = decode_row_buckets(config, data)
        self.requests: dict[str, Request] = {}
        self.finished_metrics: deque[RequestMetrics] = deque(maxlen=10_000)  # most recent first out
        self._seeds = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._steps = 0
        # the requests' token histories for penalties, logit bias and min_tokens, made at the
        # first request that asks for one (`_penalty_rows`)
        self.penalties: PenaltyState | None = None
        self._grammars: GrammarCompiler | None = None  # structured output (`_grammar_compiler`)
        self._grammars_made = threading.Lock()  # (`compile_grammar` may run on another thread)
        self._in_flight: LaunchedStep | None = None  # asynchronous scheduling: the step not read yet
        self._recent_logits: dict[int, tuple] = {}  # step index -> what `_logprobs` needs (the last two steps)
        # the last plain step's tokens on the device, for `feed_decode_tokens`
        self._no_prefill = self._replicated(np.zeros(self.scheduler.max_prefill_rows, np.int32))
        self._previous_tokens = (self._replicated(np.zeros(config.max_slots, np.int32)), self._no_prefill)
        # A mesh over several processes: process 0 schedules, the others `follow` (`multihost`)
        self._channel = StepChannel() if spans_processes(config.mesh) else None
        if self._channel is not None and config.async_scheduling:
            raise ValueError("async_scheduling=True is not supported yet on a mesh spanning several processes")

    def _init_speculation(self, sc: SpeculativeConfig | None, eagle: EagleHead | None) -> None:
        """The draft source: n-gram (host), the target's first layers, or a draft model with
        its own pages (same page ids and block tables as the target's)."""
        self.draft: DraftModel | None = None
        self._draft_vocab = None  # i32[Vd]: the draft head's token ids, when it covers a subset
        self.draft_kv = None
        self.spec_stats = SpeculativeStats.zeros(sc.num_speculative) if sc else None
        # block widths the verifying step is compiled for: all k for draft models, powers of
        # two up to k for n-gram drafts (`_narrowest`)
        self.draft_widths: list[int] = []
        if sc is not None:
            self.draft_widths = [sc.num_speculative]
            if sc.method == "ngram":
                self.draft_widths = [w for w in (1, 2, 4, 8) if w < sc.num_speculative] + self.draft_widths
        if sc is None:
            return
        if any(isinstance(layer, KiviLayerKV) for layer in entry_pytrees(self.kv.layers)):
            raise ValueError("speculative decoding overwrites rejected tokens' K/V, which KIVI cache formats (int4, int2) "
                             "cannot: they quantize a page as soon as it fills. Use 'auto', int8 or fp8 with speculation")
        if sc.method == "ngram":
            return
        mc = self.model.config
        if sc.method == "self":
            self.draft = self_draft(mc, self.model.params, sc.self_layers)
            return
        if sc.method == "eagle":
            self._init_eagle(sc, eagle)
            return
        draft = sc.draft
        if not isinstance(draft, DraftModel):
            draft = load_trained_draft(self.model, draft)
        check_draft_compatible(draft, mc)
        self.draft = draft
        if draft.vocab_ids is not None:  # on the device once, not transferred every step
            self._draft_vocab = jax.device_put(np.asarray(draft.vocab_ids, np.int32))
        self.draft_kv = self._commit(init_paged_kv(
            draft.config, self.spec, kv_head_copies=sharding.kv_head_copies(draft.config.n_kv_heads, self.config.mesh)))

    def _eagle_head(self, sc: SpeculativeConfig) -> EagleHead:
        """The configured EAGLE head, loaded and checked against the target."""
        if self.config.mesh is not None:
            raise ValueError("an EAGLE draft head on a mesh is not supported yet: use 'ngram', 'self' or 'draft'")
        head = sc.draft if isinstance(sc.draft, EagleHead) else load_eagle_head(self.model, sc.draft or DEFAULT_EAGLE_PATH)
        if head.config.d_model != self.model.config.d_model or head.embed.shape != self.model.params.embed.shape:
            raise ValueError("the EAGLE head was bound to a different target model")
        return head

    def _init_eagle(self, sc: SpeculativeConfig, head: EagleHead) -> None:
        """An EAGLE head: its one layer of pages and the features each slot carries."""
        self.draft = head
        self._draft_vocab = jax.device_put(np.asarray(head.vocab_ids, np.int32))
        k, d = sc.num_speculative, self.model.config.d_model
        self.draft_kv = self._commit(EagleState(
            kv=init_paged_kv(head.config, self.spec),
            features=jnp.zeros((self.spec.max_slots, k + 1, d), self.model.config.jnp_dtype)))

    def _replicated(self, array: np.ndarray) -> jax.Array:
        """`array` on the device, or replicated over the mesh's devices."""
        mesh = self.config.mesh
        # committed to its device like a program's outputs: jit compiles once per input placement
        return jax.device_put(array, jax.local_devices()[0]) if mesh is None else sharding.put(array, sharding.replicated(mesh))

    def _commit(self, kv):
        """Fresh caches committed to the params' device, as step outputs are: a jit signature
        includes committedness, so otherwise the first step would compile a program that
        steady state never runs again. On a mesh, `sharding` places them instead (the params'
        first device may belong to another process)."""
        if self.config.mesh is not None:
            return kv
        return jax.device_put(kv, self._placement())

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, chat: bool = False) -> str:
        """Validate and queue a request; returns its id. Raises ValueError naming the problem.
        `prompt`: a text (with `chat`, the user's turn of a chat), token ids, or a conversation
        (`[{"role": ..., "content": ...}, ...]`, rendered with the chat template). `params`
        None: `default_sampling_params()` (the model's generation config, as in vLLM)."""
        _check_not_traced("add_request")
        if self.is_follower:
            raise RuntimeError(f"process {jax.process_index()} follows process 0's schedule: requests go to "
                               "process 0's engine; call Engine.follow() here")
        if params is None:  # as vLLM: the model's generation config over SamplingParams' defaults
            params = self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if params.n != 1:
            raise ValueError(f"n={params.n}: a request is one sample; Engine.generate and chat take n (one request per "
                             "sample), or add n requests with seeds seed + i")
        ids, text = self._encode(prompt, chat)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        if params.penalized:
            self._check_penalties(params)
        matcher = None
        if params.structured_outputs is not None:  # a fresh matcher per request: it follows the request's tokens
            matcher = self._matcher(params.structured_outputs, ids)
        if params.bad_words:  # masked through the grammar's input (and with a grammar, as well as it)
            if self.model.tokenizer is None:
                raise ValueError("bad_words needs the model's tokenizer, and this model has none")
            vocab = self.model.config.vocab_size
            bad = BadWords(bad_word_ids(self.model.tokenizer, params.bad_words, vocab), vocab)
            matcher = bad if matcher is None else AllOf(matcher, bad)
        if matcher is not None and params.allowed_token_ids is not None:
            first = matcher.allowed()  # the request could not sample its first token
            if not any(allows(first, t) for t in params.allowed_token_ids):
                raise ValueError("allowed_token_ids: none of these tokens may start the output that "
                                 "structured_outputs / bad_words allow")
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        if params.max_tokens is None or params.max_tokens > room:
            # vLLM's engine: a request ends ("length") when the context is full, whatever max_tokens says
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        vocab = self.model.config.vocab_size
        if bad := [t for t in params.stop_token_ids if t >= vocab]:
            raise ValueError(f"stop_token_ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(ids) + params.max_tokens
        if self._peak_pages(total) > self.scheduler.max_request_pages:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} needs more pages than "
                             f"a request can hold ({self.scheduler.max_request_pages} pages of {self.spec.page_size} "
                             "tokens)")
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        req = Request(request_id, ids, params, seed, self.model.config.eos_ids, self.model.tokenizer, cache_salt)
        req.matcher, req.prompt_text = matcher, text
        if params.prompt_logprobs is not None:
            if self._channel is not None:
                raise ValueError("prompt_logprobs is not supported yet on a mesh spanning several processes")
            req.set_prompt_logprobs(score_tokens(self.model, ids))
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def _check_penalties(self, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: the engine and the vocabulary."""
        name = next(n for n, neutral in (("repetition_penalty", 1), ("frequency_penalty", 0), ("presence_penalty", 0),
                                          ("logit_bias", ()), ("min_tokens", 0), ("structured_outputs", None),
                                          ("allowed_token_ids", None), ("bad_words", ()))
                    if getattr(params, n) != neutral)
        if self._channel is not None:
            raise ValueError(f"{name} is not supported yet on a mesh spanning several processes")
        vocab = self.model.config.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if bad := [t for t in params.allowed_token_ids or () if t >= vocab]:
            raise ValueError(f"allowed_token_ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _grammar_compiler(self) -> GrammarCompiler:
        """llguidance's view of the vocabulary (~0.4 s), made at warm-up with `penalized` or at
        the first structured-output request."""
        with self._grammars_made:
            if self._grammars is None:
                if self.model.tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
                mc = self.model.config
                self._grammars = GrammarCompiler(self.model.tokenizer, mc.vocab_size, mc.eos_ids)
        return self._grammars

    def compile_grammar(self, structured: StructuredOutputsParams) -> None:
        """Compile a structured output's grammar now (kept: a request asking for it starts at
        once); ValueError naming what is wrong with it. Safe from any thread: a server calls
        it off the engine's thread, so a schema that takes seconds to compile stalls no one."""
        self._grammar_compiler().matcher(structured)

    def _matcher(self, structured: StructuredOutputsParams, prompt: list[int]) -> GrammarMatcher | AfterThinking:
        """The request's grammar; with a reasoning parser, from the end of its thinking."""
        grammar = self._grammar_compiler().matcher(structured)
        if self._thinking_tags is None:
            return grammar
        parser, opener, end = self._thinking_tags
        state = parser.opening(self.model.tokenizer.decode(prompt[-16:], skip_special_tokens=False))
        if state == "lead" and opener is None:  # the model cannot open a thinking the grammar refuses
            state = "answer"
        return AfterThinking(grammar, state, end, opener)

    @functools.cached_property
    def _thinking_tags(self) -> tuple[ReasoningParser, int | None, list[int]] | None:
        """The reasoning parser, the one token of its opening tag (None if spelled in several)
        and the ids of its closing tag; None without a parser."""
        parser = find_reasoning_parser(self.config.reasoning_parser)
        if parser is None:
            return None
        opener, end = parser.tag_ids(self.model.tokenizer)
        return parser, opener[0] if len(opener) == 1 else None, end

    def _peak_pages(self, tokens: int) -> int:
        """Most pages a request of `tokens` tokens holds at once: fewer than its length needs
        when pages behind a window are released or a streaming ring bounds it."""
        ps, window = self.spec.page_size, self.scheduler.release_window
        pages = min(-(-tokens // ps), self.spec.max_pages_per_seq)
        if window is not None:  # live keys window - 1 back from the chunk's first query, plus the chunk
            pages = min(pages, -(-(window - 1 + self.config.prefill_chunk) // ps) + 1)
        return pages

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its pages return to the pool. Whether it was running: an id
        that finished already (or never was) is no error, as in vLLM's `abort_request`."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        req.finish_reason = "abort"
        self.scheduler.remove(req)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None  # (asynchronous: a step not read yet)

    def _encode(self, prompt: Prompt, chat: bool) -> tuple[list[int], str | None]:
        """Token ids of a text (with `chat`, as the user's turn), a conversation (message dicts,
        always rendered with the chat template, the assistant's turn opened), ids as given, or
        a vLLM prompt dict (its text raw, without `chat`); and the text they came from."""
        tok = self.model.tokenizer
        if isinstance(prompt, Mapping):
            if unknown := sorted(set(prompt) - {*PROMPT_DICT_KEYS, "role"}):
                raise ValueError(f"a prompt dict holds 'prompt' (a text) or 'prompt_token_ids'; {unknown} are not "
                                 "supported (this engine serves text)")
            if "role" in prompt or len(prompt) != 1:
                raise ValueError("a prompt dict holds one of 'prompt' or 'prompt_token_ids' (a conversation is a "
                                 f"list of message dicts), got keys {sorted(prompt)}")
            (key, value), = prompt.items()
            if (key == "prompt") != isinstance(value, str):
                raise ValueError(f"{key} must be {'a text' if key == 'prompt' else 'token ids'}, got {type(value).__name__}")
            return self._encode(value, chat=False)
        conversation = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)
        if isinstance(prompt, str) or conversation:
            if tok is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            text = prompt
            if conversation:
                text = tok.apply_chat_template(prompt)
            elif chat:
                text = tok.apply_chat_template([{"role": "user", "content": prompt}])
            ids = tok.encode(text, add_special_tokens=not (conversation or chat))
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
            odd = next((i for i in ids if not isinstance(i, (int, np.integer)) or isinstance(i, bool)), None)
            if odd is not None:  # never cast: 1.5 is not a token id
                raise ValueError("prompt must be a string, token ids or a conversation (a list of message dicts); "
                                 f"got a {type(prompt).__name__} holding {type(odd).__name__} {odd!r:.40}")
            ids, text = [int(i) for i in ids], None
        else:
            raise ValueError("prompt must be a string, token ids or a conversation (a list of message dicts), "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids, text

    # ---- iteration --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the jitted step, return progress per request. With
        `async_scheduling`, it dispatches the next step and returns the previous one's
        progress (`_async_step`).

        A request that makes the step fail is finished with finish_reason "error" (its
        output's `error` says why; the failure is logged with its id) and its pages return
        to the pool; the others keep their pages and progress and go on next step. The
        culprits are the requests whose own row cannot be packed (`_row_error`); when none
        can be blamed, every running request fails, so a failure never repeats forever."""
        _check_not_traced("step")
        try:
            return self._unguarded_step()
        except Exception as e:  # contained: reported to the requests it fails
            return [self._fail(req, err) for req, err in self._culprits(e)]

    def _culprits(self, error: Exception) -> list[tuple[Request, Exception]]:
        """After a step raised `error`: the requests to fail, each with the error to report."""
        s = self.scheduler
        suspects = s.running + list(s.waiting)
        blamed = [(r, err) for r in suspects if (err := self._row_error(r)) is not None]
        if blamed:
            return blamed
        everyone = s.running or list(s.waiting)[:1]  # the head of the queue, if admitting it failed
        return [(r, error) for r in everyone]

    def _row_error(self, req: Request) -> Exception | None:
        """Why `req`'s row cannot go into a step on its own, or None: its params are checked
        again (they may have been altered after `SamplingParams` checked them) and packed
        into a one-row `SamplingArrays`."""
        try:
            params = dataclasses.replace(req.params)  # re-runs SamplingParams.__post_init__
            SamplingArrays.from_params([params], [req.seed])
        except Exception as e:  # any failure blames this row
            return e
        return None

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """Finish `req` with finish_reason "error" (pages freed) and log why."""
        logger.error("request %s failed inside an engine step and was stopped: %s: %s", req.request_id,
                     type(error).__name__, error, exc_info=error)
        req.finish_reason = "error"
        req.metrics.finished_time = time.perf_counter()
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        return req.error_output(f"{type(error).__name__}: {error}")

    def _unguarded_step(self) -> list[RequestOutput]:
        if self.config.async_scheduling:
            if not any(r.matcher is not None for r in self.requests.values()):
                return self._async_step()
            if self._in_flight is not None:  # a grammar's mask needs every token: read the step in flight first
                return self._read_in_flight(None)
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        drafts = self._draft_batch(plan) if self._speculates(plan) else None
        if drafts is not None and self.config.speculative.method == "ngram":
            drafts = self._narrowest(drafts)
        launched = self._launch(plan, drafts)
        result = self._collect(launched)
        kept = [int(result.accepted[r.slot]) for r in plan.decode]
        self.scheduler.commit(plan, kept)
        if isinstance(drafts, EagleBatch):  # the features the step stored for each row's slot
            for req, n in zip(plan.decode, kept):
                req.draft_carry = n + 1
            for req, _ in plan.prefill:
                req.draft_carry = 1
        launched.first_tokens = self._first_tokens(plan)
        return self._emit(launched, result, kept)

    def _async_step(self) -> list[RequestOutput]:
        """Schedule and dispatch step n + 1, then read step n's tokens and return its outputs.

        The scheduler commits step n + 1 as if each of its decode rows kept its one token;
        those tokens are "in flight" (`Request.num_in_flight`) until read, and the next step
        feeds them to its decode rows on the device (`feed_decode_tokens`). Requests that step
        n finishes (or that are aborted meanwhile) are skipped when step n + 1 is read."""
        plan = self.scheduler.schedule()
        launched = None
        if not plan.empty:
            launched = self._launch(plan, None)
            self.scheduler.commit(plan)
            launched.first_tokens = self._first_tokens(plan)
            rows = [(r, r.slot) for r in plan.decode] + [(r, self.spec.max_slots + row) for r, row in launched.first_tokens]
            for req, row in rows:
                req.num_in_flight += 1
                req.in_flight_row = row
        return self._read_in_flight(launched)

    def _read_in_flight(self, launched: LaunchedStep | None) -> list[RequestOutput]:
        """Asynchronous scheduling: read the step in flight (its outputs are returned) and
        leave `launched` in flight instead."""
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return []
        result = self._collect(previous)
        for req in previous.plan.decode + [r for r, _ in previous.first_tokens]:
            req.num_in_flight -= 1
        return self._emit(previous, result, [0] * len(previous.plan.decode))

    def _first_tokens(self, plan: SchedulePlan) -> list[tuple[Request, int]]:
        """After `commit(plan)`: (request, prefill row) of each chunk that ended its prompt and
        so sampled the request's next token."""
        return [(r, row) for (r, _), row in zip(plan.prefill, plan.prefill_rows) if r.pending == 0]

    @staticmethod
    def _feed(plan: SchedulePlan, rows: list[int], num_rows: int) -> np.ndarray | None:
        """i32[R]: where each decode row's token comes from (`feed_decode_tokens`), or None
        when the host has every one (always, without asynchronous scheduling)."""
        feed = np.full(num_rows, -1, np.int32)
        for req, row in zip(plan.decode, rows):
            if req.num_in_flight:
                feed[row] = req.in_flight_row
        return feed if (feed >= 0).any() else None

    def _emit(self, launched: LaunchedStep, result: StepResult, kept: list[int]) -> list[RequestOutput]:
        """Hand a step's tokens to its requests: append, check stops, finish, report.
        `kept[i]`: the drafts `plan.decode[i]` kept."""
        plan, drafts = launched.plan, launched.drafts
        now = time.perf_counter()
        # (request, tokens, its row in the logprob arrays: decode [B] / blocks [B, k + 1], or prefill [P])
        # slots as launched: a request preempted since (asynchronous) has none now
        emitted = [(r, result.tokens[b, : n + 1].tolist(), (0, row))
                   for r, b, row, n in zip(plan.decode, launched.slots, launched.rows, kept)]
        emitted += [(r, [int(result.prefill[row])], (1, row)) for r, row in launched.first_tokens]
        emitted = [e for e in emitted if self.requests.get(e[0].request_id) is e[0]]  # asynchronous: not aborted since
        drafted = {} if drafts is None else {id(r): (int(drafts.num_draft[row]), n)
                                             for r, row, n in zip(plan.decode, launched.rows, kept)}
        wanted = any(r.params.logprobs is not None for r, _, _ in emitted)
        host_logprobs = self._logprobs(launched.index, result.step_logits) if wanted else None
        outputs = []
        for req, tokens, (source, row) in emitted:
            try:  # one request's failure here (its text, its stop strings) must not lose the others' tokens
                for count, token in enumerate(tokens, 1):
                    lp = None
                    if req.params.logprobs is not None:
                        lp = _logprob_at(host_logprobs[source], row, count - 1, req.params.logprobs)
                    req.append_token(token, now, lp)
                    if req.finish_reason is not None:
                        break
                if self.spec_stats and source == 0:
                    self._record_speculation(req, *drafted.get(id(req), (0, 0)), count)
                if req.finish_reason is not None:
                    req.metrics.finished_time = now
                    self.finished_metrics.append(req.metrics)
                    self.scheduler.remove(req)
                    del self.requests[req.request_id]
                if (out := req.take_output()) is not None:
                    outputs.append(out)
            except Exception as e:  # contained: reported to this request
                outputs.append(self._fail(req, e))
        return outputs

    def _launch(self, plan: SchedulePlan, drafts: DraftBatch | EagleBatch | None) -> LaunchedStep:
        """Build the step's batch and dispatch its program (not waiting for it). Across
        processes, the followers run it too."""
        penalized = self._penalty_rows(plan)
        batch, rows = self._batch(plan, draft_width(drafts), penalized)
        if drafts is not None:
            drafts = drafts_by_row(drafts, rows, len(batch.decode_tokens))
        feed = self._feed(plan, rows, len(batch.decode_tokens))
        updates = self._tables.updates(self.scheduler.take_changed_rows())
        self._steps += 1
        if self._channel is not None:
            self._channel.publish(("run", self._steps, batch, drafts, feed, updates))
        outputs = self._dispatch(self._steps, batch, drafts, feed, updates, penalized)
        return LaunchedStep(plan, drafts, self._steps, outputs, [r.slot for r in plan.decode], rows)

    def _penalty_rows(self, plan: SchedulePlan) -> bool:
        """Write the penalty history of each request admitted since the last step into its
        slot (neutral for requests without penalties, once any request had them); True when
        a request of `plan` has penalties, so the step runs a program that applies them."""
        admitted = self.scheduler.take_admitted()
        if self.penalties is None and any(r.params.penalized for r in admitted):
            state = init_penalty_state(self.spec.max_slots, self.model.config.vocab_size)
            placement = self._placement()
            self.penalties = jax.tree.map(lambda a: sharding.put(np.asarray(a), placement), state)
        if self.penalties is not None:
            vocab, eos_ids = self.model.config.vocab_size, self.model.config.eos_ids
            for req in admitted:
                row = slot_history(vocab, req.prompt, req.generated, req.params, eos_ids)
                self.penalties = self._compiles.call(set_slot, self.penalties, np.int32(req.slot), row)
        return plan_penalized(plan)

    def _placement(self) -> jax.sharding.Sharding:
        """Where fresh state the steps read lives (caches, penalties): committed to the params'
        device, as step outputs are (see `_commit`); on a mesh, replicated."""
        if self.config.mesh is not None:
            return sharding.replicated(self.config.mesh)
        return jax.sharding.SingleDeviceSharding(next(iter(jax.tree.leaves(self.model.params)[0].devices())))

    def _penalty_shapes(self) -> PenaltyState:
        """The penalty state's shapes and placement, made or not (programs compile against them)."""
        if self.penalties is not None:
            return _abstract(self.penalties)
        placement = self._placement()
        state = jax.eval_shape(lambda: init_penalty_state(self.spec.max_slots, self.model.config.vocab_size))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placement), state)

    def _dispatch(self, index: int, batch: StepBatch, drafts: DraftBatch | None, feed: np.ndarray | None,
                  updates: list[TableUpdates], penalized: bool = False) -> tuple:
        """Dispatch step `index`'s program -> its outputs, still on the device: (tokens i32[B]
        or i32[B, k + 1] by slot, accepted i32[B] or None, prefill tokens i32[P] or None, what
        `_logprobs` needs). `feed` i32[R]: decode rows whose token the previous step made; `updates`:
        the block-table entries that changed since the previous step, written in first."""
        for update in updates:
            tables = self._compiles.call(self._apply_tables, self.kv.block_tables, self._place_updates(update))
            self.kv = dataclasses.replace(self.kv, block_tables=tables)
        key = program_key(batch, drafts, penalized)
        if self._compiler is not None and key not in self._ran:
            self._compiler.claim(key)  # compiled in the background already, or now, never twice
        elif key not in self._ran and key not in self._compiled and kernels_by_default(self.config.attention_impl):
            self._compile(key)  # a kernel that fails to compile falls back here, not mid-step
        if self.config.async_scheduling:  # every step, so the program always sees its tokens placed alike
            feed = np.full(batch.decode_tokens.shape, -1, np.int32) if feed is None else feed
            batch = dataclasses.replace(batch, decode_tokens=self._compiles.call(
                feed_decode_tokens, batch.decode_tokens, feed, *self._previous_tokens))
        fn, args = self._program(batch, drafts, self.kv, self.draft_kv, self.attention_impl(key),
                                 self.penalties if penalized else None)
        if drafts is None:
            self.kv, out = self._compiles.call(fn, *args)
            device_tokens, accepted = out.decode_tokens, None  # i32[B]
            prefill = self._no_prefill if out.prefill_tokens is None else out.prefill_tokens
            self._previous_tokens = (device_tokens, prefill)
        else:
            self.kv, self.draft_kv, out = self._compiles.call(fn, *args)
            device_tokens, accepted = out.tokens, out.num_accepted  # i32[B, k + 1], i32[B] by slot
        if out.penalties is not None:
            self.penalties = out.penalties
        self._ran.add(key)
        self._recent_logits = {index: step_logits(out),
                               **{i: v for i, v in self._recent_logits.items() if i == index - 1}}
        return device_tokens, accepted, out.prefill_tokens

    def _collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and bring them to the host. Slot b emits
        tokens[b, : accepted[b] + 1] (k = 0 without speculation)."""
        device_tokens, accepted, prefill = launched.outputs
        tokens = np.asarray(device_tokens)
        if accepted is None:
            tokens, accepted = tokens[:, None], np.zeros(tokens.shape, np.int32)
        else:
            accepted = np.asarray(accepted)
        return StepResult(tokens, accepted, None if prefill is None else np.asarray(prefill),
                          self._recent_logits[launched.index])

    def _logprobs(self, index: int, step_logits: tuple) -> tuple[TokenLogprobs, TokenLogprobs | None]:
        """The logprob program over step `index`'s logits and tokens (`_dispatch`), fetched to
        the host: (decode [B] or blocks [B, k + 1], prefill [P] or None). Its compiles count as
        the engine's: one per step shape, at the first step that asks for logprobs."""
        if self._channel is not None:
            self._channel.publish(("logprobs", index))
        return jax.device_get(self._compiles.call(step_logprobs, *step_logits))

    # ---- several processes ------------------------------------------------------------------

    @property
    def is_follower(self) -> bool:
        """True on every process but 0 when the mesh spans processes: this engine only runs
        the programs process 0's engine decides (`follow`)."""
        return self._channel is not None and not self._channel.is_leader

    def follow(self) -> None:
        """Follower: run every program process 0's engine runs, with its batches, until it
        `close`s. Compiles the programs in the background meanwhile (`start_warmup`)."""
        if not self.is_follower:
            raise RuntimeError("Engine.follow() is for processes other than 0 of a mesh spanning several processes")
        self.start_warmup()
        while True:
            kind, *args = self._channel.receive()
            if kind == "stop":
                return
            if kind == "run":
                jax.block_until_ready(self._dispatch(*args)[0])  # in step with the leader, which reads each step
            elif kind == "logprobs":
                self._compiles.call(step_logprobs, *self._recent_logits[args[0]])

    def close(self) -> None:
        """Leader: release the followers (their `follow` returns). Nothing to do otherwise."""
        if self._channel is not None and self._channel.is_leader:
            self._channel.publish(("stop",))

    def attention_impl(self, key: ProgramKey) -> str:
        """The attention impl program `key` compiles with: the config's, or "reference" where
        its kernel failed to compile on this device (`fallbacks`)."""
        return "reference" if key in self._fallbacks else self.config.attention_impl

    @property
    def fallbacks(self) -> dict[ProgramKey, str]:
        """Programs running the reference because a kernel failed to compile: key -> kernel name."""
        return dict(self._fallbacks)

    def _program(self, batch: StepBatch, drafts: DraftBatch | None, kv, draft_kv, impl: str | None = None,
                 penalties: PenaltyState | None = None) -> tuple[jax.stages.Wrapped, tuple]:
        """The jitted step for `batch` with attention `impl` (default: the config's) and its
        positional arguments (jit refuses keywords next to in_shardings: `sharding.shard_engine`)."""
        m, c = self.model, self.config
        impl = c.attention_impl if impl is None else impl
        if drafts is None:
            return self._step, (m.params, m.config, kv, self._place(batch), impl, c.mesh, penalties)
        d = self.draft
        if isinstance(drafts, EagleBatch):
            return eagle_step, (m.params, m.config, kv, self._place(batch), drafts, d.params, d.lm_head,
                                self._draft_vocab, draft_kv, d.config, impl, penalties)
        return self._spec_step, (
            m.params, m.config, kv, self._place(batch), self._place_drafts(drafts), None if d is None else d.params,
            self._draft_vocab, draft_kv, None if d is None else d.config, 0 if d is None else d.shares_target_layers,
            impl, c.mesh, penalties)

    def _speculates(self, plan: SchedulePlan) -> bool:
        """Whether this step drafts: a speculating engine does unless its decode rows reach
        `SpeculativeConfig.disable_by_batch_size`."""
        if not self.spec_stats:
            return False
        limit = self.config.speculative.disable_by_batch_size
        return limit is None or len(plan.decode) < limit

    def _draft_batch(self, plan: SchedulePlan) -> DraftBatch | EagleBatch:
        """How many drafts each decoding request verifies, in `plan.decode`'s order (`_launch`
        lays them out by decode row); n-gram drafts are proposed here."""
        sc = self.config.speculative
        if sc.method == "eagle":
            return self._eagle_batch(plan)
        tokens = np.zeros((len(plan.decode), sc.num_speculative), np.int32)
        num_draft = np.zeros(len(plan.decode), np.int32)
        allowed = self._draft_masks(len(plan.decode), sc.num_speculative, plan_penalized(plan))
        for i, (req, lookahead) in enumerate(zip(plan.decode, plan.lookahead)):
            if sc.method == "ngram" and lookahead:
                proposal = self._ngram_index(req).propose(lookahead)
                if req.matcher is not None and len(proposal):  # only drafts the grammar allows, with its masks
                    masks = req.matcher.draft_masks(proposal)
                    proposal, allowed[i, : len(masks)] = proposal[: len(masks)], masks
                tokens[i, : len(proposal)] = proposal
                num_draft[i] = len(proposal)
            else:
                num_draft[i] = 0 if req.matcher is not None else lookahead
        return DraftBatch(tokens=tokens, num_draft=num_draft, allowed=allowed)

    def _draft_masks(self, rows: int, width: int, penalized: bool) -> np.ndarray | None:
        """i32[rows, width, W] allowing every token, or None: host drafts (n-gram) in a step
        with penalties or grammars carry the grammar mask after each draft (constrained rows
        fill theirs in); a model's drafts are made in the program, where no grammar is, so
        constrained rows verify none of those."""
        if not penalized or self.config.speculative.method != "ngram":
            return None
        return allow_all((rows, width), self.model.config.vocab_size)

    def _eagle_batch(self, plan: SchedulePlan) -> EagleBatch:
        """The pairs each decoding request carried (its last `draft_carry` tokens follow the
        carried features), in `plan.decode`'s order, and which prefill rows continue a
        carried feature."""
        k, n = self.config.speculative.num_speculative, len(plan.decode)
        head_tokens = np.zeros((n, k + 1), np.int32)
        carried, num_draft = np.zeros(n, np.int32), np.zeros(n, np.int32)
        for i, (req, lookahead) in enumerate(zip(plan.decode, plan.lookahead)):
            c = req.draft_carry
            if c:
                # the tokens after the carried features, the pending one last (a prompt token
                # when the prompt's last chunk was a single token)
                head_tokens[i, :c] = req.tokens(req.num_tokens - c, req.num_tokens)
                carried[i], num_draft[i] = c, 0 if req.matcher is not None else lookahead
        prefill_carried = np.zeros(self.scheduler.max_prefill_rows, bool)
        for (req, _), row in zip(plan.prefill, plan.prefill_rows):
            prefill_carried[row] = req.draft_carry > 0
        return EagleBatch(num_draft=num_draft, head_tokens=head_tokens, carried=carried,
                          prefill_carried=prefill_carried if plan.prefill else None)

    def _ngram_index(self, req: Request) -> NgramIndex:
        """The request's n-gram index, brought up to date with its new tokens (O(new tokens),
        not a re-scan of the sequence every step)."""
        sc = self.config.speculative
        if req.ngram_index is None:
            req.ngram_index = NgramIndex(sc.ngram_max, sc.ngram_min, len(req.prompt), sc.ngram_prompt_first,
                                         sc.ngram_short_draft)
        req.ngram_index.sync(req.prompt, req.generated)
        return req.ngram_index

    def _narrowest(self, drafts: DraftBatch) -> DraftBatch | None:
        """Host drafts (n-gram) are often shorter than k: verify them in the narrowest
        compiled block width (powers of two up to k) that holds the longest, and run the
        plain one-token program when no slot has any (verifying costs ~(width + 1) tokens
        per slot)."""
        longest = int(drafts.num_draft.max(initial=0))
        if longest == 0:
            return None
        width = next(w for w in self.draft_widths if w >= longest)
        return DraftBatch(tokens=drafts.tokens[:, :width], num_draft=drafts.num_draft,
                          allowed=None if drafts.allowed is None else drafts.allowed[:, :width])

    def _record_speculation(self, req: Request, num_draft: int, num_accepted: int, emitted: int) -> None:
        if req.metrics.speculative is None:
            req.metrics.speculative = SpeculativeStats.zeros(self.config.speculative.num_speculative)
        for stats in (req.metrics.speculative, self.spec_stats):
            stats.record(num_draft, num_accepted, emitted)

    def program_keys(self, penalized: bool = False) -> list[ProgramKey]:
        """Every program traffic can need, in the order warm-up compiles them: the smallest
        context bucket first (what short requests run), then the largest (it fits every
        sequence), then the rest. Per bucket: decode + prefill, decode only; with speculation,
        the verifying step at each draft width (n-gram, or with `disable_by_batch_size`: also
        the plain step, for steps with nothing to verify or too many rows). Each at max_slots
        decode rows (they serve any step); then the decode-only programs of the smaller row
        buckets, in the same order. With `penalized`, then the programs that apply penalties,
        logit bias and grammars, in the smallest and the largest bucket (none on a mesh spanning
        several processes, where such requests are refused)."""
        drafts = [0]
        if self.spec_stats:
            sc = self.config.speculative
            drafts = self.draft_widths + ([0] if sc.method == "ngram" or sc.disable_by_batch_size else [])
        buckets, full = self.context_buckets, self.config.max_slots
        order = [buckets[0]] + ([buckets[-1]] if len(buckets) > 1 else []) + buckets[1:-1]
        keys = [(w, prefill, d, full, False) for w in order for prefill in (True, False) for d in drafts]
        keys += [(w, False, d, r, False) for w in order for r in self.decode_row_buckets if r < full for d in drafts]
        if penalized and self._channel is None:  # (refused across processes) smallest + largest: every length
            ends = {buckets[0], buckets[-1]}
            keys += [(*key[:4], True) for key in keys if key[0] in ends]
        return keys

    def warmup(self, penalized: bool = False, logprobs: bool = False) -> int:
        """Compile every program traffic can need (`program_keys`) now; returns how many step
        programs. With `penalized`, also those of requests with penalties, a logit bias or a
        grammar; with `logprobs`, the program that computes logprobs for requests that ask
        (one per shape of a step's logits), else compiled at the first such step.
        `start_warmup` does the same in the background while the engine serves."""
        self._warm_logprobs |= logprobs
        keys = self.program_keys(penalized)
        for key in keys:
            self._compile(key)
        self._compile_side_programs(penalized)
        return len(keys)

    def start_warmup(self, penalized: bool = False, logprobs: bool = False) -> None:
        """Compile every program on a background thread, the smallest first (those with
        penalties last), while `step` serves with the programs compiled so far: a step runs
        the smallest compiled context bucket that holds its sequences, and compiles (or waits
        for) one itself only when none does. `ready` says when the smallest bucket's plain
        programs are there."""
        if self._compiler is None:
            self._warm_logprobs |= logprobs
            self._compile_side_programs(penalized)
            self._compiler = BackgroundCompiler(self._compile, self.program_keys(penalized))

    def _compile_side_programs(self, penalized: bool = False) -> None:
        """Compile the tiny programs every step may call with the steps: the block-table
        update, with asynchronous scheduling `feed_decode_tokens`, with `penalized` the
        write of an admitted request's penalty row (`set_slot`) and llguidance's view of the
        vocabulary."""
        penalized = penalized and self._channel is None  # (such requests are refused across processes)
        tables = jax.ShapeDtypeStruct(self.kv.block_tables.shape, jnp.int32, sharding=self.kv.block_tables.sharding)
        with self._compiles.attribute():
            self._apply_tables.lower(tables, self._place_updates(self._tables.idle())).compile()
            if penalized:
                row = slot_history(self.model.config.vocab_size, [], [])
                set_slot.lower(self._penalty_shapes(), np.int32(0), row).compile()
        if penalized and self.model.tokenizer is not None:
            self._grammar_compiler()  # not a program, but as slow as one: not at the first grammar
        if self.config.async_scheduling:
            for rows in self.decode_row_buckets:
                r = np.zeros(rows, np.int32)
                with self._compiles.attribute():
                    feed_decode_tokens.lower(r, r, *self._previous_tokens).compile()

    @property
    def ready(self) -> bool:
        """False only while `start_warmup` has not yet compiled the smallest bucket's programs
        (without it, steps compile what they need when they need it)."""
        if self._compiler is None:
            return True
        full = self.config.max_slots  # programs of the smallest bucket that serve any step there
        first = [k for k in self.program_keys() if k[0] == self.context_buckets[0] and k[3] == full]
        return all(k in self._ran or self._compiler.compiled(k) for k in first)

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Block until `start_warmup`'s background compiles are done (at once without one);
        False if `timeout` seconds ran out first."""
        return self._compiler is None or self._compiler.wait(timeout)

    @property
    def warming_up(self) -> bool:
        """True while `start_warmup`'s background compiles are still going."""
        return self._compiler is not None and self._compiler.busy

    def _compile(self, key: ProgramKey) -> None:
        """Compile the program `key` without running it: jit's own caches keep the executable
        for the first real call. The caches are abstract (`ShapeDtypeStruct`s with their
        placements), so this may run while `step` donates the real ones."""
        if key in self._ran or key in self._compiled:
            return
        width, with_prefill, draft_width, decode_rows, penalized = key
        b = decode_rows
        drafts = None if draft_width == 0 else DraftBatch(tokens=np.zeros((b, draft_width), np.int32),
                                                          num_draft=np.zeros(b, np.int32),
                                                          allowed=self._draft_masks(b, draft_width, penalized))
        if draft_width and self.config.speculative.method == "eagle":
            rows = self.scheduler.max_prefill_rows
            drafts = EagleBatch(num_draft=np.zeros(b, np.int32), head_tokens=np.zeros((b, draft_width + 1), np.int32),
                                carried=np.zeros(b, np.int32), prefill_carried=np.zeros(rows, bool) if with_prefill else None)
        batch, kv = self._idle_batch(width, with_prefill, decode_rows, penalized), _abstract(self.kv)
        if self.config.async_scheduling:  # its decode tokens come from `feed_decode_tokens`, on the device
            batch = dataclasses.replace(batch, decode_tokens=self._replicated(batch.decode_tokens))
        draft_kv = None if self.draft_kv is None else _abstract(self.draft_kv)
        penalties = self._penalty_shapes() if penalized else None
        with self._compiles.attribute():
            try:
                fn, args = self._program(batch, drafts, kv, draft_kv, self.attention_impl(key), penalties)
                compiled = fn.lower(*args).compile()
            except Exception as err:  # noqa: BLE001 - only kernel programs fall back; others re-raise
                if key in self._fallbacks or not kernels_by_default(self.config.attention_impl):
                    raise
                self._fall_back(key, err)
                fn, args = self._program(batch, drafts, kv, draft_kv, "reference", penalties)
                compiled = fn.lower(*args).compile()
        self._compiled.add(key)
        if self._warm_logprobs:
            self._compile_logprobs(compiled.out_info[-1])

    def _compile_logprobs(self, out) -> None:
        """Compile the logprob program (`_logprobs`) for a step's outputs `out` (abstract), once
        per shape: step programs of different context buckets share their logits' shapes."""
        logits = _abstract(step_logits(out))
        shapes = tuple(None if a is None else a.shape for a in logits)
        if shapes not in self._logprob_shapes:
            with self._compiles.attribute():
                step_logprobs.lower(*logits).compile()
            self._logprob_shapes.add(shapes)

    def _fall_back(self, key: ProgramKey, err: Exception) -> None:
        """Program `key`'s kernels failed to compile: run it with the reference from now on,
        warning once per kernel (the one the error names, else every kernel of this backend)."""
        text = "".join(traceback.format_exception(err))
        named = [k for k in kernel_names() if k in text] or list(kernel_names())
        kernel = " / ".join(named)
        self._fallbacks[key] = kernel
        if kernel not in self._warned:
            self._warned.add(kernel)
            logger.warning("attention kernel %s failed to compile on %s (%s: %s); programs using it run the "
                           "jnp reference instead (attention_impl='reference' silences this)", kernel,
                           jax.devices()[0].device_kind, type(err).__name__, (str(err).splitlines() or [""])[0])

    def _idle_prefill(self, penalized: bool = False) -> PrefillBatch:
        """Prefill rows with no tokens; each idle row points at the first slot of the data
        replica its row block belongs to, so it never refers to another replica's pages.
        With `penalized`, bitmasks allowing every token (structured output)."""
        s = self.scheduler
        rows, chunk = s.max_prefill_rows, self.config.prefill_chunk
        slots = np.arange(rows, dtype=np.int32) // s.prefill_rows_per_replica * s.slots_per_replica
        return PrefillBatch(tokens=np.zeros((rows, chunk), np.int32), slots=slots, num_new=np.zeros(rows, np.int32),
                            shared=np.zeros(rows, np.int32),
                            allowed=allow_all(rows, self.model.config.vocab_size) if penalized else None)

    def _idle_batch(self, width: int, with_prefill: bool, rows: int, penalized: bool = False) -> StepBatch:
        b = self.spec.max_slots
        return StepBatch(
            width=width, lengths=np.zeros(b, np.int32), decode_tokens=np.zeros(rows, np.int32),
            decode_slots=np.arange(rows, dtype=np.int32), decode_active=np.zeros(rows, bool),
            sampling=SamplingArrays.from_params([SamplingParams(temperature=0)] * b, [0] * b),
            prefill=self._idle_prefill(penalized) if with_prefill else None,
            allowed=allow_all(rows, self.model.config.vocab_size) if penalized else None,
        )

    def _batch(self, plan: SchedulePlan, draft_width: int = 0, penalized: bool = False) -> tuple[StepBatch, list[int]]:
        """The step's batch, and the decode row of each of `plan.decode`'s requests: row b =
        slot b at max_slots rows (mesh replicas rely on it), else the requests in order, the
        idle rows after them."""
        b = self.spec.max_slots
        width, num_rows = self._shape(max(len(r.pages) for r in self.scheduler.running), len(plan.decode),
                                      bool(plan.prefill), draft_width, penalized)
        lengths = np.zeros(b, np.int32)
        params: list[SamplingParams] = [SamplingParams(temperature=0)] * b
        seeds = [0] * b
        for req in self.scheduler.running:
            lengths[req.slot] = req.num_computed
            params[req.slot], seeds[req.slot] = req.params, req.seed
        decode_tokens = np.zeros(num_rows, np.int32)
        active = np.zeros(num_rows, bool)
        slots = np.arange(num_rows, dtype=np.int32)
        rows = [r.slot for r in plan.decode] if num_rows == b else list(range(len(plan.decode)))
        for req, row in zip(plan.decode, rows):
            if not req.num_in_flight:  # else the device feeds it (`_feed`)
                decode_tokens[row] = req.token_at(req.num_computed)
            active[row], slots[row] = True, req.slot
        prefill = None
        if plan.prefill:
            prefill = self._idle_prefill(penalized)
            for (req, n), row in zip(plan.prefill, plan.prefill_rows):
                prefill.tokens[row, :n] = req.tokens(req.num_computed, req.num_computed + n)
                prefill.slots[row], prefill.num_new[row], prefill.shared[row] = req.slot, n, req.num_shared_tokens
                if req.matcher is not None and n == req.pending:  # the chunk ends the sequence: it samples
                    prefill.allowed[row] = req.matcher.allowed()
        allowed = None
        if penalized:  # the programs that process logits take the grammars' bitmasks too
            allowed = allow_all(num_rows, self.model.config.vocab_size)
            for req, row in zip(plan.decode, rows):
                if req.matcher is not None:
                    allowed[row] = req.matcher.allowed()
        # numpy leaves: jit transfers them in one go, cheaper than a jnp.asarray each
        return StepBatch(
            width=width, lengths=lengths, decode_tokens=decode_tokens, decode_slots=slots, decode_active=active,
            sampling=SamplingArrays.from_params(params, seeds), prefill=prefill, allowed=allowed,
        ), rows

    def _shape(self, pages: int, decoding: int, with_prefill: bool, draft_width: int,
               penalized: bool = False) -> tuple[int, int]:
        """(context bucket, decode rows) of the step's program. Attention gathers `width`
        pages per row: the smallest bucket that holds `pages` (so short contexts do not pay
        for max_model_len); the decode group has the fewest rows that hold `decoding`
        requests (decode-only plain steps; max_slots otherwise). While `start_warmup` is
        still compiling, the first such shape whose program is compiled; else the smallest."""
        fits = [w for w in self.context_buckets if w >= pages]
        rows = [self.config.max_slots]
        if not with_prefill:
            rows = [r for r in self.decode_row_buckets if r >= decoding]
        if self._compiler is not None:
            for w in fits:
                for r in rows:
                    key = (w, with_prefill, draft_width, r, penalized)
                    if key in self._ran or self._compiler.compiled(key):
                        return w, r
        return fits[0], rows[0]

    # ---- conveniences -----------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False, progress: bool = False, *,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run prompts to completion (alongside anything already queued); one output per prompt,
        in input order, holding its `params.n` samples (`RequestOutput.outputs`; sample i seeded
        with seed + i). One prompt (a text, token ids, a conversation, a vLLM prompt dict) may be
        given alone: a list of one output. `sampling_params` and `use_tqdm` are vLLM's names for
        `params` and `progress`."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("pass params or sampling_params (vLLM's name for it), not both")
            params = sampling_params
        progress = progress if use_tqdm is None else use_tqdm
        if _is_one_prompt(prompts):
            prompts = [prompts]
        if isinstance(prompts, np.ndarray) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a prompt (a text, token ids, a conversation) or a non-empty list of them")
        params = self.default_sampling_params() if params is None else params
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per) != len(prompts):
            raise ValueError(f"got {len(per)} SamplingParams for {len(prompts)} prompts")
        ids: list[list[str]] = []  # per prompt, its samples' request ids
        try:
            for prompt, p in zip(prompts, per):
                ids.append([self.add_request(prompt, sample, chat=chat) for sample in _samples(p)])
        except ValueError:
            for rid in itertools.chain.from_iterable(ids):
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        mine = set(itertools.chain.from_iterable(ids))
        bar = _progress_bar(len(mine), progress)
        while len(final) < len(mine):
            for out in self.step():
                if out.finished and out.request_id in mine:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[rids[0]] if len(rids) == 1 else dataclasses.replace(final[rids[0]], samples=[final[r] for r in rids])
                for rids in ids]

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's `get_default_sampling_params`: `SamplingParams` with the sampling defaults of
        the model's `generation_config.json` (`Model.generation_config`), the rest as usual."""
        return SamplingParams(**self.model.generation_config)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Sequence[Mapping[str, Any]] | None = None,
             chat_template: str | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             progress: bool = False, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: a conversation (or a list of them) rendered with the chat template
        (or `chat_template`: a template's text or file) and run to completion; one output per
        conversation, as `generate` gives. `chat_template_kwargs` are the template's own
        variables (Qwen3's `enable_thinking`), `tools` the functions it shows."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tok = self.model.tokenizer
        if tok is None:
            raise ValueError("chat needs the model's tokenizer, and this model has none")
        if chat_template is not None:
            tok = tok.with_chat_template(chat_template)
        options = dict(chat_template_kwargs or {}) | ({} if tools is None else {"tools": list(tools)})
        texts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt and not continue_final_message,
                                         continue_final_message=continue_final_message, **options)
                 for c in conversations]
        outs = self.generate([tok.encode(t, add_special_tokens=False) for t in texts], params, progress=progress,
                             sampling_params=sampling_params, use_tqdm=use_tqdm)
        return [_with_prompt(out, text) for out, text in zip(outs, texts)]

    def get_tokenizer(self) -> Tokenizer | None:
        """vLLM's `LLM.get_tokenizer`: the model's tokenizer (None for a checkpoint without one)."""
        return self.model.tokenizer

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               chat: bool = False, cache_salt: str | None = None) -> Iterator[str]:
        """Yield one request's text as it is produced (other requests advance too)."""
        rid = self.add_request(prompt, params, chat=chat, cache_salt=cache_salt)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        if out.error is not None:
                            raise RuntimeError(f"request {rid} failed: {out.error}")
                        if out.delta_text:
                            yield out.delta_text
                        if out.finished:
                            return
        finally:
            if rid in self.requests:
                self.abort(rid)

    def request_kv_bytes(self, request_id: str) -> int:
        """Bytes of the KV pools request `request_id` holds now, measured from the pools: per
        layer cache, its bytes per pool page times the pages the request holds there (its
        pages in the global pool, or its slot's ring in a windowed layer's own pool)."""
        req = self.requests[request_id]
        held = {False: sum(p != NULL_PAGE for p in req.pages), True: self.window_ring or 0}
        total = 0
        for ring, entry in self._layer_pools():
            leaves = jax.tree.leaves(entry)
            pool = leaves[0].shape[isinstance(entry, LayerStack)]
            total += sum(leaf.nbytes for leaf in leaves) * held[ring] // pool
        return total

    def _layer_pools(self) -> Iterator[tuple[bool, object]]:
        """(in a windowed ring pool?, cache) per entry of `kv.layers` (a layer or a run of alike layers)."""
        first = 0
        for entry in self.kv.layers:
            yield self.window_ring is not None and self.model.config.window(first) is not None, entry
            first += entry.n if isinstance(entry, LayerStack) else 1

    def metrics(self) -> EngineMetrics:
        s = self.scheduler
        ring = self.window_ring or 0
        return EngineMetrics(
            running=len(s.running), waiting=len(s.waiting), pages_used=s.num_allocated,
            pages_free=s.num_free, pages_cached=s.num_cached,
            window_pages_used=ring * len(s.running), window_pages_total=ring * self.spec.max_slots,
            prefix_hit_rate=s.stats.prefix_hits / max(s.stats.prefix_queries, 1),
            prefix_hits=s.stats.prefix_hits, prefix_queries=s.stats.prefix_queries,
            preemptions=s.stats.preemptions, steps=self._steps, compiled_programs=self._compiles.compiled,
            cached_programs=self._compiles.from_cache,
            speculative=copy.deepcopy(self.spec_stats),
        )


def draft_width(drafts: DraftBatch | EagleBatch | None) -> int:
    if drafts is None:
        return 0
    return drafts.width if isinstance(drafts, EagleBatch) else drafts.tokens.shape[1]


def drafts_by_row(drafts: DraftBatch | EagleBatch, rows: list[int], num_rows: int) -> DraftBatch | EagleBatch:
    """Drafts listed in `plan.decode`'s order, laid out in the step's decode rows: request i
    at row `rows[i]` of `num_rows` (idle rows verify nothing). Prefill-row fields stay."""
    def lay_out(a: np.ndarray, idle: int = 0) -> np.ndarray:
        out = np.full((num_rows, *a.shape[1:]), idle, a.dtype)
        out[rows] = a[: len(rows)]
        return out

    if isinstance(drafts, EagleBatch):
        return dataclasses.replace(drafts, **{f: lay_out(getattr(drafts, f)) for f in ("num_draft", "head_tokens", "carried")})
    allowed = None if drafts.allowed is None else lay_out(drafts.allowed, idle=-1)  # idle rows: every token allowed
    return DraftBatch(tokens=lay_out(drafts.tokens), num_draft=lay_out(drafts.num_draft), allowed=allowed)


def _with_prompt(out: RequestOutput, text: str) -> RequestOutput:
    """`out` (and its samples) naming `text` as their prompt."""
    samples = None if out.samples is None else [dataclasses.replace(o, prompt=text) for o in out.samples]
    return dataclasses.replace(out, prompt=text, samples=samples)


def _samples(params: SamplingParams) -> list[SamplingParams]:
    """One request's params per sample of `params.n` (sample i seeded with seed + i, as the
    server's choices), each giving only its final output (nothing in between is copied)."""
    if not isinstance(params, SamplingParams):
        return [params]  # refused by add_request, by name
    kind = "final_only" if params.output_kind == "cumulative" else params.output_kind
    seeds = [None] * params.n if params.seed is None else [(params.seed + i) % 2**32 for i in range(params.n)]
    return [dataclasses.replace(params, n=1, seed=seed, output_kind=kind) for seed in seeds]


def _is_one_prompt(prompts: Any) -> bool:
    """A text, a 1-d array or list of token ids, a conversation (a list of message dicts), or
    a vLLM prompt dict."""
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
        return True
    first = prompts[0] if isinstance(prompts, (list, tuple)) and prompts else None
    return isinstance(first, (int, np.integer)) or (isinstance(first, Mapping) and not set(first) & set(PROMPT_DICT_KEYS))


def _abstract(tree):
    """`ShapeDtypeStruct`s with the placements of `tree`'s arrays (compile without them)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def plan_penalized(plan: SchedulePlan) -> bool:
    """Whether a request of `plan` changes its logits (penalties, bias, a grammar): the step
    runs the programs that do."""
    return any(r.params.penalized for r in itertools.chain(plan.decode, (r for r, _ in plan.prefill)))


def program_key(batch: StepBatch, drafts: DraftBatch | None, penalized: bool = False) -> ProgramKey:
    """Which program runs `batch` with `drafts` (and penalties)."""
    return (batch.width, batch.prefill is not None, draft_width(drafts), batch.decode_tokens.shape[0], penalized)


def _logprob_at(lp: TokenLogprobs, row: int, j: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """Token j of a row's block (j = 0 where the arrays have no block axis) from host arrays
    -> (its logprob, its n top alternatives as (id, logprob))."""
    index = (row, j) if lp.logprob.ndim == 2 else (row,)
    ids, values = lp.top_ids[index][:n].tolist(), lp.top_logprobs[index][:n].tolist()
    return float(lp.logprob[index]), list(zip(ids, values))


def release_window(config: ModelConfig) -> int | None:
    """The window behind which a sequence's pages can be freed: the widest layer window
    when every layer is windowed (Mistral), else None (a global layer needs every page)."""
    windows = config.layer_windows
    return max(windows) if windows and None not in windows else None


def window_ring(config: ModelConfig, page_size: int, max_chunk: int, pages_per_seq: int) -> int | None:
    """Ring pages per slot for the windowed layers of a hybrid model (some layers windowed, some
    global; `jaxinfer.kv.window_ring`), or None: no such layers, every layer windowed (pages
    behind the window are released instead: `release_window`), or a ring no smaller than a
    whole sequence's block table."""
    windows = [w for w in config.layer_windows if w is not None]
    if not windows or len(windows) == config.n_layers:
        return None
    ring = ring_pages(max(windows), max_chunk, page_size)
    return ring if ring < pages_per_seq else None


def decode_row_buckets(config: EngineConfig, data_replicas: int) -> list[int]:
    """The decode-row counts the decode-only programs are compiled for
    (`EngineConfig.decode_row_buckets`), ascending, max_slots last."""
    full = config.max_slots
    if data_replicas > 1 or (config.speculative is not None and config.mesh is not None):
        return [full]
    rows = config.decode_row_buckets
    if rows is None and config.scheduling == "static":
        rows = ()
    elif rows is None:  # 1, 4, 16, ... up to max_slots / 4: each bucket at least 4x the one below
        rows = (1, *itertools.takewhile(lambda r: r <= full // 4, (4**i for i in itertools.count(1))))
    return sorted(set(rows) | {full})


def context_buckets(max_pages: int, smallest: int) -> list[int]:
    """Block-table widths the step is compiled for: `smallest`, x4 each, then `max_pages`.
    Measured on CPU (BENCHMARKS.md, startup): a decode step costs about the same at any
    width up to ~512 tokens, so narrower buckets only add programs to compile."""
    buckets, w = [], max(smallest, 1)
    while w < max_pages:
        buckets.append(w)
        w *= 4
    return buckets + [max_pages]


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled)


try:
    from jax._src.core import trace_state_clean as _trace_state_clean  # (no public name)
except ImportError:  # a jax without it: under a transformation even a constant is staged, a tracer
    def _trace_state_clean() -> bool:
        return not isinstance(jnp.zeros((), jnp.int32), jax.core.Tracer)


def _check_not_traced(method: str) -> None:
    """The engine is host-side Python over device state: under a jax transformation its
    state would take tracers, and every later request would fail."""
    if not _trace_state_clean():
        raise RuntimeError(f"Engine.{method} was called under a jax transformation (jax.jit, vmap, grad, scan, ...): "
                           "the engine is host-side Python; call it outside, and inside jitted code call the pure "
                           "functions (jaxinfer.forward, ...)")
