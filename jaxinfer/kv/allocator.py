"""Host-side bookkeeping of physical KV pages (plain Python, no jax).

Every page except `NULL_PAGE` is in exactly one of three states::

    free    -- in the free queue, holds nothing anyone can ask for
    in use  -- refcount > 0: named by the block table of one request, or of several when
               it holds a shared prefix (a prefix-cache hit)
    cached  -- refcount 0 but registered under a block hash: its KV can still be reused;
               it waits in an LRU queue and is evicted (hash dropped) only when an
               allocation finds no free page

A page is registered in the prefix cache only once it holds a full block of prompt
tokens, and registered pages are never written again (a request that shares them starts
writing at the next page boundary).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from jaxinfer.kv.pages import NULL_PAGE


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free; nothing is allocated."""


class PageAllocator:
    """Refcounted pages with an LRU prefix cache of full pages.

    Allocation is all-or-nothing and prefers never-cached free pages to evicting cached
    ones. Freed pages go to the back of their queue, so a page just released is the last
    to be reused. Releasing a page that is not in use raises.
    """

    def __init__(self, num_pages: int, pages: range | None = None):
        """Manage `pages` (default: every page of a `num_pages` pool but NULL_PAGE); a data-
        parallel engine gives each replica its own range (`partition_pages`)."""
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page {NULL_PAGE} is reserved)")
        self.num_pages = num_pages
        self.pages = range(NULL_PAGE + 1, num_pages) if pages is None else pages
        if not self.pages or self.pages.start < 0 or self.pages.stop > num_pages or NULL_PAGE in self.pages:
            raise ValueError(f"pages {self.pages} must be a non-empty range inside [1, {num_pages})")
        self._free: deque[int] = deque(self.pages)
        self._refcount: Counter[int] = Counter()
        self._hash_of: dict[int, bytes] = {}  # page -> block hash (cached or in use)
        self._page_of: dict[bytes, int] = {}  # block hash -> page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0; oldest first

    # ---- counts -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages an allocation can take right now (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_allocated(self) -> int:
        """Pages in use by at least one request."""
        return len(self._refcount)

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (in use or evictable)."""
        return len(self._hash_of)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    # ---- allocation -------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n=})")
        if n > self.num_free:
            raise OutOfPagesError(f"asked for {n} pages, only {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced pages become free or cached."""
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages freed twice in one call: {pages}")
        unknown = [p for p in pages if self._refcount[p] <= 0]  # Counter: reading inserts nothing
        if unknown:
            raise ValueError(f"pages {unknown} are not allocated")
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                del self._refcount[p]
                if p in self._hash_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    # ---- prefix cache -----------------------------------------------------------------------

    def register(self, page: int, block_hash: bytes) -> None:
        """Record that in-use `page` holds the full block `block_hash`."""
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        if block_hash in self._page_of or page in self._hash_of:
            return  # an identical block is already cached (or this page already is)
        self._hash_of[page] = block_hash
        self._page_of[block_hash] = page

    def cached_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks `lookup` would find (takes nothing)."""
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self._page_of:
            n += 1
        return n

    def lookup(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `block_hashes`, each taken with a reference."""
        pages = []
        for h in block_hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for p in pages:
            self._evictable.pop(p, None)
            self._refcount[p] += 1
        return pages

    def check_invariants(self) -> None:
        """Every page in exactly one state; cache maps consistent (used by tests)."""
        in_use = set(self._refcount)
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is free twice"
        assert not (in_use & free) and not (in_use & evictable) and not (free & evictable)
        assert in_use | free | evictable == set(self.pages)
        assert all(c > 0 for c in self._refcount.values()), "refcount <= 0 in use"
        assert evictable <= set(self._hash_of) and not (free & set(self._hash_of))
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())


def partition_pages(num_pages: int, parts: int) -> list[range]:
    """Split a pool into `parts` equal, contiguous page ranges (one per data-parallel replica,
    matching the pool's sharding over `data`); NULL_PAGE is left out of the first.

        partition_pages(12, 3) -> [range(1, 4), range(4, 8), range(8, 12)]
    """
    if parts < 1 or num_pages % parts or num_pages // parts < 2:
        raise ValueError(f"num_pages={num_pages} must be a multiple of {parts} partitions with >= 2 pages each")
    size = num_pages // parts
    return [range(max(r * size, NULL_PAGE + 1), (r + 1) * size) for r in range(parts)]


def check_replica_pages(block_tables: np.ndarray, num_pages: int, parts: int) -> None:
    """Raise ValueError where a slot's block table (i32[max_slots, max_pages]) holds a page
    outside its data replica's range: on a `data=parts` mesh slot s belongs to replica
    s // (max_slots / parts), which holds only `partition_pages(num_pages, parts)[r]`; another
    replica's page would not be written and reads would land on another page, silently."""
    tables = np.asarray(block_tables)
    ranges = partition_pages(num_pages, parts)
    replica = np.arange(len(tables)) // max(len(tables) // parts, 1)  # i32[max_slots]
    low = np.asarray([ranges[r].start for r in replica])[:, None]
    high = np.asarray([ranges[r].stop for r in replica])[:, None]
    bad = (tables != NULL_PAGE) & ((tables < low) | (tables >= high))
    if bad.any():
        slot, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"slot {slot} (data replica {replica[slot]} of {parts}) holds page {int(tables[slot, j])}, "
                         f"outside its replica's pages {ranges[replica[slot]]}: allocate each slot's pages from "
                         f"partition_pages({num_pages}, {parts})[slot // {len(tables) // parts}] "
                         "(PageAllocator(num_pages, pages=...))")
