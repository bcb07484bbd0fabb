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

Cached pages: the prefix cache (prefix.py) marks the pages it holds a reference to
(`mark_cached`). A cached page whose only owner is the prefix cache is *reclaimable*: the
cache can give it back on demand. `num_reclaimable` counts them, kept up to date by every
operation, so "could n pages be had" is `num_free + num_reclaimable >= n` in O(1).
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
        self._cached = [False] * num_pages
        self._reclaimable = 0

    @property
    def num_free(self) -> int:
        return len(self._free_list)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free_list)

    @property
    def num_reclaimable(self) -> int:
        """Cached pages nobody but the prefix cache holds."""
        return self._reclaimable

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
            self._set_refcount(page, self._refcounts[page] + 1)

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
            if self._cached[page] and times >= self._refcounts[page]:
                raise ValueError(f"free of page {page} would drop the prefix cache's reference "
                                 f"(refcount {self._refcounts[page]}, freed {times} times): use uncache")
        released = []
        for page, times in releases.items():
            self._set_refcount(page, self._refcounts[page] - times)
            if self._refcounts[page] == 0:
                self._free_list.append(page)
                released.append(page)
        return released

    # ---- cached pages (the prefix cache's references) ----------------------------------
    def is_cached(self, page: int) -> bool:
        self._check_id(page)
        return self._cached[page]

    def mark_cached(self, page: int) -> None:
        """The caller's reference to `page` (which it must hold) becomes the prefix cache's."""
        self._check_id(page)
        if self._refcounts[page] == 0 or self._cached[page]:
            raise ValueError(f"mark_cached of page {page}: refcount {self._refcounts[page]}, "
                             f"cached {self._cached[page]}")
        self._cached[page] = True
        self._reclaimable += self._refcounts[page] == 1

    def uncache(self, page: int) -> bool:
        """Drop the prefix cache's reference to `page`; True when the page became free."""
        self._check_id(page)
        if not self._cached[page]:
            raise ValueError(f"uncache of page {page}, which the prefix cache does not hold")
        self._reclaimable -= self._refcounts[page] == 1
        self._cached[page] = False
        return bool(self.free([page]))

    def _set_refcount(self, page: int, count: int) -> None:
        if self._cached[page]:
            self._reclaimable += (count == 1) - (self._refcounts[page] == 1)
        self._refcounts[page] = count

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page} outside [0, {self.num_pages})")
