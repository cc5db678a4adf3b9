"""Iteration-level scheduling on the host: admission, chunked prefill, page growth, preemption.

Each iteration the scheduler decides which running requests decode one token and which
prefill a chunk, making sure every token it schedules has a page to land in::

    waiting ──admit (FCFS, free slot, pages for the first chunk)──> running
       ^                                                              │
       └──── preempted (pages freed, recomputed later) <── pool empty ┤
                                                                      └─> finished

Preemption takes the most recently admitted request, frees all its pages and puts it
back at the head of the queue; on readmission it re-prefills its prompt and the tokens it
already generated (the prefix cache often still holds most of them) and continues.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from jaxinfer.engine.request import Request, RequestStatus
from jaxinfer.kv.allocator import OutOfPagesError, PageAllocator
from jaxinfer.kv.prefix_cache import block_hashes


@dataclasses.dataclass
class SchedulePlan:
    decode: list[Request]  # one pending token each
    prefill: list[tuple[Request, int]]  # (request, tokens in this chunk)

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
                 max_prefill_rows: int, max_tokens_per_step: int, enable_prefix_caching: bool,
                 cache_root: bytes, static_batching: bool = False):
        self.max_slots = max_slots
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.max_prefill_rows = max_prefill_rows
        self.max_tokens_per_step = max_tokens_per_step
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_root = cache_root
        self.static_batching = static_batching
        self.allocator = PageAllocator(num_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.free_slots: list[int] = list(range(max_slots))[::-1]
        self.stats = SchedulerStats()

    # ---- queue ------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the scheduler (finished or aborted) and free its pages."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self._release(request)
            self.running.remove(request)
        request.status = RequestStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one iteration ----------------------------------------------------------------------

    def schedule(self) -> SchedulePlan:
        self._admit()
        budget = self.max_tokens_per_step
        decode: list[Request] = []
        prefill: list[tuple[Request, int]] = []
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted while making room for an earlier request
            if req.pending == 1 and budget >= 1:
                n = 1
            elif req.pending > 1 and len(prefill) < self.max_prefill_rows and budget >= 1:
                n = min(req.pending, self.prefill_chunk, budget)
            else:
                continue
            if not self._grow(req, req.num_computed + n):
                continue  # req itself was preempted
            budget -= n
            if req.pending == 1:
                decode.append(req)
            else:
                prefill.append((req, n))
        decode = [r for r in decode if r.status is RequestStatus.RUNNING]
        prefill = [(r, n) for r, n in prefill if r.status is RequestStatus.RUNNING]
        return SchedulePlan(decode=decode, prefill=prefill)

    def commit(self, plan: SchedulePlan) -> None:
        """After the step ran: advance progress and enter full prompt pages in the cache."""
        for req in plan.decode:
            req.num_computed += 1
        for req, n in plan.prefill:
            req.num_computed += n
        if self.enable_prefix_caching:
            for req in self.running:
                self._register_full_prompt_pages(req)

    # ---- internals --------------------------------------------------------------------------

    def _admit(self) -> None:
        if self.static_batching and self.running:
            return
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            cached = self._lookup_prefix(req)
            first_chunk = min(len(req.all_tokens) - len(cached) * self.page_size, self.prefill_chunk)
            need = self._pages_for(len(cached) * self.page_size + first_chunk) - len(cached)
            if need > self.allocator.num_free:
                self.allocator.free(cached)
                return  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            req.pages = cached
            req.num_registered_pages = len(cached)
            req.num_computed = len(cached) * self.page_size
            req.metrics.num_cached_prompt_tokens = max(req.metrics.num_cached_prompt_tokens, req.num_computed)
            req.slot = self.free_slots.pop()
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _lookup_prefix(self, req: Request) -> list[int]:
        """Cached pages for the request's leading full prompt pages (each with a reference).

        At most `(len(prompt) - 1) // page_size` pages: the page holding the last prompt
        token is always recomputed, since its logits give the first generated token.
        """
        if not self.enable_prefix_caching:
            return []
        if req.block_hashes is None:
            req.block_hashes = block_hashes(req.prompt, self.page_size, self.cache_root, req.cache_salt)
        usable = req.block_hashes[: (len(req.prompt) - 1) // self.page_size]
        pages = self.allocator.lookup(usable)
        self.stats.prefix_queries += len(usable)
        self.stats.prefix_hits += len(pages)
        return pages

    def _register_full_prompt_pages(self, req: Request) -> None:
        full = min(req.num_computed, len(req.prompt)) // self.page_size
        for i in range(req.num_registered_pages, full):
            self.allocator.register(req.pages[i], req.block_hashes[i])
        req.num_registered_pages = max(req.num_registered_pages, full)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _grow(self, req: Request, tokens: int) -> bool:
        """Give `req` pages for `tokens` tokens, preempting later requests if the pool is
        empty. Returns False if `req` had to be preempted itself."""
        need = self._pages_for(tokens) - len(req.pages)
        while need > 0:
            try:
                req.pages += self.allocator.allocate(need)
                return True
            except OutOfPagesError:
                victim = self.running[-1]
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
        self.allocator.free(req.pages)
        req.pages = []
        req.num_registered_pages = 0
        self.free_slots.append(req.slot)
        req.slot = None
