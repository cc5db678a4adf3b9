"""Iteration-level scheduling on the host: admission, chunked prefill, page growth, preemption.

Each iteration the scheduler decides which running requests decode one token and which
prefill a chunk, making sure every token it schedules has a page to land in::

    waiting ──admit (FCFS, free slot, pages for the first chunk)──> running
       ^                                                              │
       └──── preempted (pages freed, recomputed later) <── pool empty ┤
                                                                      └─> finished

Preemption takes the most recently admitted request (of the same data-parallel replica),
frees all its pages and puts it back at the head of the queue; on readmission it
re-prefills its prompt and the tokens it already generated (the prefix cache often still
holds most of them) and continues.

With `data_parallel=D` (a mesh's `data` axis), slots and pages are split into D replicas:
slot s belongs to replica s // (max_slots / D) and takes pages only from that replica's
range of the pool (`partition_pages`), which lives on that replica's devices. A new request
goes to the replica with a free slot holding the longest cached prefix of its prompt (then
the most free pages). Prefill rows are split the same way: each replica gets
ceil(max_prefill_rows / D) rows of its own (block r of the batch's rows), so the devices of
a replica prefill only their own requests.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from jaxinfer.engine.request import Request, RequestStatus
from jaxinfer.kv.allocator import OutOfPagesError, PageAllocator, partition_pages
from jaxinfer.kv.pages import NULL_PAGE
from jaxinfer.kv.prefix_cache import block_hashes


@dataclasses.dataclass
class SchedulePlan:
    decode: list[Request]  # one pending token each
    prefill: list[tuple[Request, int]]  # (request, tokens in this chunk)
    prefill_rows: list[int] = dataclasses.field(default_factory=list)  # per prefill entry: its batch row
    lookahead: list[int] = dataclasses.field(default_factory=list)  # per decode request: draft tokens it may verify

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclasses.dataclass
class SchedulerStats:
    preemptions: int = 0
    prefix_queries: int = 0  # full prompt pages looked up
    prefix_hits: int = 0  # of those, found in the cache


class Scheduler:
    def __init__(self, *, max_slots: int, page_size: int, num_pages: int, prefill_chunk: int,
                 max_prefill_rows: int, max_tokens_per_step: int | None, enable_prefix_caching: bool,
                 cache_root: bytes, static_batching: bool = False, release_window: int | None = None,
                 max_pages_per_seq: int | None = None, num_speculative: int = 0, data_parallel: int = 1,
                 hit_recompute: int = 0):
        """`release_window=W`: pages wholly behind the last W tokens return to the pool as a
        request advances (every layer windowed). `max_pages_per_seq`: a request never holds
        more pages (a streaming ring reuses its pages in place). `num_speculative=k`: a
        decoding request also gets budget and pages for up to k draft tokens. `data_parallel=D`:
        slots, pages and prefill rows split into D replicas (see the module docstring).
        `max_tokens_per_step=None`: every decode token, draft and prefill row fits.
        `hit_recompute=N`: a prefix hit of H tokens resumes at the page boundary at or before
        H - N, not at H (a hybrid model's rings need those keys:
        `jaxinfer.kv.window_ring.hit_recompute`); it keeps the H tokens' shared pages."""
        if max_slots % data_parallel:
            raise ValueError(f"max_slots={max_slots} is not divisible by data_parallel={data_parallel}")
        self.hit_recompute = hit_recompute
        self.num_speculative = num_speculative
        self.release_window = release_window
        self.max_pages_per_seq = max_pages_per_seq
        self.max_slots = max_slots
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.prefill_rows_per_replica = -(-max_prefill_rows // data_parallel)
        self.max_prefill_rows = self.prefill_rows_per_replica * data_parallel  # rows of the batch
        self.max_tokens_per_step = max_tokens_per_step or (
            max_slots * (1 + num_speculative) + self.max_prefill_rows * prefill_chunk)
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_root = cache_root
        self.static_batching = static_batching
        self.slots_per_replica = max_slots // data_parallel
        self.allocators = [PageAllocator(num_pages, r) for r in partition_pages(num_pages, data_parallel)]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.free_slots: list[int] = list(range(max_slots))[::-1]
        self.stats = SchedulerStats()
        # slots whose page list changed since `take_changed_rows` (the engine's device tables follow)
        self.changed_slots: set[int] = set()
        self.admitted: list[Request] = []  # requests given a slot since `take_admitted`

    @property
    def allocator(self) -> PageAllocator:
        """The page allocator (one replica; with several, see `allocators`)."""
        if len(self.allocators) != 1:
            raise AttributeError(f"{len(self.allocators)} data-parallel replicas each have an allocator: use .allocators")
        return self.allocators[0]

    def replica_of(self, slot: int) -> int:
        return slot // self.slots_per_replica

    def _allocator(self, req: Request) -> PageAllocator:
        return self.allocators[self.replica_of(req.slot)]

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.allocators)

    @property
    def num_allocated(self) -> int:
        return sum(a.num_allocated for a in self.allocators)

    @property
    def num_cached(self) -> int:
        return sum(a.num_cached for a in self.allocators)

    @property
    def max_request_pages(self) -> int:
        """Pages one request can ever hold: its replica's share of the pool."""
        return min(len(a.pages) for a in self.allocators)

    # ---- queue ------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the scheduler (finished or aborted) and free its pages. Its
        status says which queue holds it: a finished request costs a scan of the running
        requests (at most max_slots), never of the waiting queue."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self._release(request)
            self.running.remove(request)
        request.status = RequestStatus.FINISHED

    def take_changed_rows(self) -> list[tuple[int, list[int]]]:
        """(slot, its pages now; [] when free) for every slot whose pages changed since the
        last call: what the device's block tables must take in (`jaxinfer.kv.table_updates`)."""
        if not self.changed_slots:
            return []
        holder = {r.slot: r.pages for r in self.running}
        rows = [(slot, holder.get(slot, [])) for slot in sorted(self.changed_slots)]
        self.changed_slots.clear()
        return rows

    def take_admitted(self) -> list[Request]:
        """Requests admitted to a slot since the last call that still hold it, in admission
        order (what slot-indexed device state must be set for: `jaxinfer.penalties`)."""
        admitted, self.admitted = self.admitted, []
        return [r for r in admitted if r.slot is not None]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one iteration ----------------------------------------------------------------------

    def schedule(self) -> SchedulePlan:
        for req in [r for r in self.running if r.last_token_in_flight]:
            self.remove(req)  # asynchronous: done once its token lands; its slot and pages serve others now
        self._admit()
        budget = self.max_tokens_per_step
        decode: list[Request] = []
        lookahead: dict[int, int] = {}
        prefill: list[tuple[Request, int]] = []
        prefill_rows: dict[int, int] = {}  # id(request) -> its row: replica r's rows are block r
        rows_taken = [0] * len(self.allocators)
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted while making room for an earlier request
            if req.pending == 1 and budget >= 1:
                n = 1 + min(self._lookahead(req), budget - 1)
            elif req.pending > 1 and rows_taken[self.replica_of(req.slot)] < self.prefill_rows_per_replica and budget >= 1:
                self._extend_prefix_hit(req)
                n = min(req.pending, self.prefill_chunk, budget)
            else:
                continue
            if not self._grow(req, req.num_computed + n):
                continue  # req itself was preempted
            budget -= n
            if req.pending == 1:
                decode.append(req)
                lookahead[id(req)] = n - 1
            else:
                replica = self.replica_of(req.slot)
                prefill.append((req, n))
                prefill_rows[id(req)] = replica * self.prefill_rows_per_replica + rows_taken[replica]
                rows_taken[replica] += 1
        decode = [r for r in decode if r.status is RequestStatus.RUNNING]
        prefill = [(r, n) for r, n in prefill if r.status is RequestStatus.RUNNING]
        return SchedulePlan(decode=decode, prefill=prefill, prefill_rows=[prefill_rows[id(r)] for r, _ in prefill],
                            lookahead=[lookahead[id(r)] for r in decode])

    def _lookahead(self, req: Request) -> int:
        """Draft tokens a decoding request may verify: at most k, never past max_tokens."""
        if not self.num_speculative or not req.params.speculative:
            return 0
        return max(0, min(self.num_speculative, req.params.max_tokens - len(req.generated) - 1))

    def commit(self, plan: SchedulePlan, accepted: list[int] | None = None) -> None:
        """After the step ran: advance progress and enter full prompt pages in the cache.
        `accepted[i]`: drafts kept by `plan.decode[i]` (its K/V past those is discarded)."""
        for i, req in enumerate(plan.decode):
            req.num_computed += 1 + (accepted[i] if accepted else 0)
        for req, n in plan.prefill:
            req.num_computed += n
        if self.enable_prefix_caching:
            for req in self.running:
                self._register_full_prompt_pages(req)
        if self.release_window is not None:
            for req in self.running:
                self._release_behind_window(req)

    # ---- internals --------------------------------------------------------------------------

    def _admit(self) -> None:
        if self.static_batching and self.running:
            return
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            slot = self._pick_slot(req)
            allocator = self.allocators[self.replica_of(slot)]
            cached = self._lookup_prefix(req, allocator)
            start = self._resume_at(len(cached) * self.page_size)
            first_chunk = min(req.num_tokens - start, self.prefill_chunk)
            need = self._pages_for(start + first_chunk) - len(cached)
            if need > allocator.num_free:
                allocator.free(cached)
                return  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if self.enable_prefix_caching:  # once per admission: a head that waits for pages looks up again
                self.stats.prefix_queries += len(self._usable_hashes(req))
                self.stats.prefix_hits += len(cached)
            self.free_slots.remove(slot)
            req.pages = cached
            self.changed_slots.add(slot)
            req.num_registered_pages = len(cached)
            req.num_shared_tokens = len(cached) * self.page_size
            req.num_computed = start
            req.metrics.num_cached_prompt_tokens = start
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or time.perf_counter()
            req.slot = slot
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.admitted.append(req)

    def _pick_slot(self, req: Request) -> int:
        """A free slot for `req`: in the replica whose pages hold the longest cached prefix of
        its prompt, then the one with the most free pages (one replica: the last freed slot)."""
        if len(self.allocators) == 1:
            return self.free_slots[-1]
        usable = self._usable_hashes(req)

        def preference(slot: int) -> tuple[int, int]:
            a = self.allocators[self.replica_of(slot)]
            return a.cached_prefix(usable), a.num_free

        return max(reversed(self.free_slots), key=preference)

    def _usable_hashes(self, req: Request) -> list[bytes]:
        if not self.enable_prefix_caching:
            return []
        if req.block_hashes is None:
            req.block_hashes = block_hashes(req.prompt, self.page_size, self.cache_root, req.cache_salt)
        return req.block_hashes[: (len(req.prompt) - 1) // self.page_size]

    def _lookup_prefix(self, req: Request, allocator: PageAllocator) -> list[int]:
        """Cached pages for the request's leading full prompt pages (each with a reference).

        At most `(len(prompt) - 1) // page_size` pages: the page holding the last prompt
        token is always recomputed, since its logits give the first generated token.
        """
        if not self.enable_prefix_caching:
            return []
        return allocator.lookup(self._usable_hashes(req))

    def _extend_prefix_hit(self, req: Request) -> None:
        """Before a prefill chunk: take pages another request has cached since admission.

        Requests admitted together all miss at admission; the first to prefill a shared
        prefix registers its pages, and the others pick them up here instead of
        recomputing them (but for the last `hit_recompute` tokens, when that skips any).
        Only at a page boundary with no page allocated ahead.
        """
        if not self.enable_prefix_caching or req.num_computed != len(req.pages) * self.page_size:
            return
        done = len(req.pages)
        usable = req.block_hashes[done : (len(req.prompt) - 1) // self.page_size]
        if not usable:
            return
        pages = self._allocator(req).lookup(usable)
        self.stats.prefix_hits += len(pages)
        req.pages += pages
        self.changed_slots.add(req.slot)
        req.num_registered_pages = len(req.pages)
        req.num_shared_tokens = len(req.pages) * self.page_size
        start = max(req.num_computed, self._resume_at(req.num_shared_tokens))
        req.metrics.num_cached_prompt_tokens += start - req.num_computed
        req.num_computed = start

    def _resume_at(self, hit: int) -> int:
        """Where a request whose first `hit` tokens are in cached pages resumes computing: `hit`,
        or the page boundary `hit_recompute` tokens or more before it (see `__init__`)."""
        return max(hit - self.hit_recompute, 0) // self.page_size * self.page_size

    def _register_full_prompt_pages(self, req: Request) -> None:
        full = min(req.num_computed, len(req.prompt)) // self.page_size
        for i in range(req.num_registered_pages, full):
            self._allocator(req).register(req.pages[i], req.block_hashes[i])
        req.num_registered_pages = max(req.num_registered_pages, full)

    def _pages_for(self, tokens: int) -> int:
        pages = -(-tokens // self.page_size)
        return pages if self.max_pages_per_seq is None else min(pages, self.max_pages_per_seq)

    def _release_behind_window(self, req: Request) -> None:
        """Free the pages no future query can see: the next query (index num_computed) sees
        keys > num_computed - W, so page i goes once (i + 1) * page_size <= num_computed - W + 1.
        Its block-table entry becomes NULL_PAGE (released pages are always a prefix)::

            W = 5, page_size = 4, num_computed = 13:  the next query (13) sees keys 9..13
            pages  [0: 0-3][1: 4-7][2: 8-11][3: 12-15]  ->  NULL NULL p2 p3
        """
        dead = max(req.num_computed - self.release_window + 1, 0) // self.page_size
        for i in range(min(dead, len(req.pages)) - 1, -1, -1):
            if req.pages[i] == NULL_PAGE:
                break
            self._allocator(req).free([req.pages[i]])
            req.pages[i] = NULL_PAGE
            self.changed_slots.add(req.slot)

    def _grow(self, req: Request, tokens: int) -> bool:
        """Give `req` pages for `tokens` tokens, preempting later requests if the pool is
        empty. Returns False if `req` had to be preempted itself."""
        need = self._pages_for(tokens) - len(req.pages)
        replica = self.replica_of(req.slot)
        while need > 0:
            try:
                req.pages += self.allocators[replica].allocate(need)
                self.changed_slots.add(req.slot)
                return True
            except OutOfPagesError:  # only a request of the same replica frees pages req can use
                victim = next(r for r in reversed(self.running) if self.replica_of(r.slot) == replica)
                self._preempt(victim)
                if victim is req:
                    return False
        return True

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.metrics.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self._allocator(req).free([p for p in req.pages if p != NULL_PAGE])
        req.pages = []
        self.changed_slots.add(req.slot)
        req.num_registered_pages = 0
        self.free_slots.append(req.slot)
        req.slot = None
        req.draft_carry = 0
