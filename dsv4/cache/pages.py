"""Reference-counted allocator of fixed-size cache pages, addressed by integer id.

The allocator knows nothing about what a page holds (SWA keys, compressed entries, ...);
pools.py owns the tensors and layout.py the page math. It only tracks which of the
`num_pages` ids are in use and by how many owners.

Invariants:
  * every page id in [0, num_pages) is either free (refcount 0, on the free list exactly
    once) or used (refcount >= 1, not on the free list);
  * num_free + num_used == num_pages;
  * every operation validates all its ids first and then changes state, so a failed call
    changes nothing (all-or-nothing).
Free pages are handed out in FIFO order of release (initially ascending ids), so the page
released longest ago is reused first and the order is deterministic. Every operation
costs O(1) per page it names.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """Fewer free pages than requested; nothing was allocated."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"cannot allocate {requested} pages: only {free} free")
        self.requested = requested
        self.free = free


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        self._free_list: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free_list)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free_list)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refcounts[page]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free_list)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, each with refcount 1. Raises OutOfPages (allocating
        nothing) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_list):
            raise OutOfPages(n, len(self._free_list))
        pages = [self._free_list.popleft() for _ in range(n)]
        for page in pages:
            self._refcounts[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one owner to each listed page (a page listed twice gains two). Every page
        must be in use: a free page cannot be shared."""
        pages = list(pages)
        for page in pages:
            self._check_id(page)
            if self._refcounts[page] == 0:
                raise ValueError(f"incref of free page {page}")
        for page in pages:
            self._refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drop one owner from each listed page (a page listed twice loses two). Returns
        the pages whose refcount reached 0, in the order they went back to the free list.
        Freeing more times than a page has owners (a double free) raises ValueError."""
        releases = Counter(pages)
        for page, times in releases.items():
            self._check_id(page)
            if times > self._refcounts[page]:
                raise ValueError(f"double free of page {page}: refcount "
                                 f"{self._refcounts[page]}, freed {times} times")
        released = []
        for page, times in releases.items():
            self._refcounts[page] -= times
            if self._refcounts[page] == 0:
                self._free_list.append(page)
                released.append(page)
        return released

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page} outside [0, {self.num_pages})")
