"""Host-side allocator of physical KV pages (plain Python, no jax)."""

from __future__ import annotations

from collections import deque

from jaxinfer.kv.paged_state import NULL_PAGE


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free; nothing is allocated."""


class PageAllocator:
    """A free list over pages `1 .. num_pages - 1` (page `NULL_PAGE` is reserved).

    Freed pages go to the back of the queue, so a page just released is the last to be
    reused (stale data lingers least where it could be confused with fresh data).
    Allocation is all-or-nothing; freeing a page that is not allocated raises.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page {NULL_PAGE} is reserved)")
        self.num_pages = num_pages
        self._free: deque[int] = deque(p for p in range(num_pages) if p != NULL_PAGE)
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n=})")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, only {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages freed twice in one call: {pages}")
        unknown = [p for p in pages if p not in self._allocated]
        if unknown:
            raise ValueError(f"pages {unknown} are not allocated")
        self._allocated.difference_update(pages)
        self._free.extend(pages)
