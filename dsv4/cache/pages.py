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
costs O(1) per page it names: refcounts and cached flags are numpy arrays, and a list of
more than a few pages is validated and applied in vectorised passes (no Python work per
page; a list naming a page more than once is tallied by one sort, O(n log n) in C), so freeing a long
request's thousands of pages stays cheap; a few pages go one at a time, with the same
results and errors.

Cached pages: the prefix cache (prefix.py) marks the pages it holds a reference to
(`mark_cached`). A cached page whose only owner is the prefix cache is *reclaimable*: the
cache can give it back on demand. `num_reclaimable` counts them, kept up to date by every
operation, so "could n pages be had" is `num_free + num_reclaimable >= n` in O(1).
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from itertools import compress, repeat

import numpy as np

_FEW = 16       # lists of at most this many pages are handled page by page (numpy's fixed cost is more)


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
        self._refcounts = np.zeros(num_pages, np.int64)
        self._free_list: deque[int] = deque(range(num_pages))
        self._cached = np.zeros(num_pages, bool)
        self._reclaimable = 0
        self._listed_at = np.zeros(num_pages, np.int64)     # scratch of `_tally`: a position per page

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
        return self._refcounts.item(page)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free_list)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, each with refcount 1. Raises OutOfPages (allocating
        nothing) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_list):
            raise OutOfPages(n, len(self._free_list))
        pages = list(map(deque.popleft, repeat(self._free_list, n)))
        self._refcounts[np.fromiter(pages, np.int64, n)] = 1       # (free pages are never cached)
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one owner to each listed page (a page listed twice gains two). Every page
        must be in use: a free page cannot be shared."""
        pages = pages if isinstance(pages, list) else list(pages)
        if len(pages) <= _FEW:
            return self._incref_each(pages)
        ids = np.fromiter(pages, np.int64, len(pages))
        inside = (ids >= 0) & (ids < self.num_pages)
        bad = ~inside | (self._refcounts[np.where(inside, ids, 0)] == 0)
        if bad.any():                                    # the first bad page as listed
            page = int(ids[bad.argmax()])
            self._check_id(page)
            raise ValueError(f"incref of free page {page}")
        distinct, times = self._tally(ids)
        counts = self._refcounts[distinct]
        self._set_refcounts(distinct, counts, counts + times, self._cached[distinct])

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drop one owner from each listed page (a page listed twice loses two). Returns
        the pages whose refcount reached 0, in the order they went back to the free list
        (that of their first listing). Freeing more times than a page has owners (a double
        free) raises ValueError."""
        pages = pages if isinstance(pages, list) else list(pages)
        if len(pages) <= _FEW:
            return self._free_each(pages)
        ids = np.fromiter(pages, np.int64, len(pages))
        distinct, times = self._tally(ids)
        counts, cached = self._check_free(distinct, times)
        self._set_refcounts(distinct, counts, counts - times, cached)
        gone = counts == times
        if distinct is ids:                 # none repeated: the caller's ints, in their order
            released = list(compress(pages, gone.tolist()))
        else:
            released = distinct[gone].tolist()
        self._free_list.extend(released)
        return released

    # ---- cached pages (the prefix cache's references) ----------------------------------
    def is_cached(self, page: int) -> bool:
        self._check_id(page)
        return self._cached.item(page)

    def mark_cached(self, page: int) -> None:
        """The caller's reference to `page` (which it must hold) becomes the prefix cache's."""
        self._check_id(page)
        count, cached = self._refcounts.item(page), self._cached.item(page)
        if count == 0 or cached:
            raise ValueError(f"mark_cached of page {page}: refcount {count}, cached {cached}")
        self._cached[page] = True
        self._reclaimable += count == 1

    def uncache(self, page: int) -> bool:
        """Drop the prefix cache's reference to `page`; True when the page became free."""
        self._check_id(page)
        if not self._cached.item(page):
            raise ValueError(f"uncache of page {page}, which the prefix cache does not hold")
        self._reclaimable -= self._refcounts.item(page) == 1
        self._cached[page] = False
        return bool(self.free([page]))

    # ---- many pages: numpy -------------------------------------------------------------
    def _tally(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct ids in order of first listing, how many times each is listed) [m]
        int64; O(len(ids)) when they are distinct, valid page ids (the common case)."""
        n = len(ids)
        if n and ids.min() >= 0 and ids.max() < self.num_pages:
            at, listed = self._listed_at, np.arange(n)
            at[ids] = listed                  # a repeated id keeps one of its positions
            if (at[ids] == listed).all():     # every id kept its own: none is repeated
                return ids, np.ones(n, np.int64)
        distinct, first, times = np.unique(ids, return_index=True, return_counts=True)
        order = np.argsort(first)
        return distinct[order], times[order]

    def _check_free(self, pages: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Raise the error `_free_each` would for the first bad one of these distinct pages
        (listed `times` each); else return their refcounts and cached flags."""
        inside = (pages >= 0) & (pages < self.num_pages)
        at = np.where(inside, pages, 0)
        counts, cached = np.where(inside, self._refcounts[at], 0), self._cached[at] & inside
        bad = ~inside | (times > counts) | (cached & (times >= counts))
        if bad.any():
            i = int(bad.argmax())
            self._check_free_one(int(pages[i]), int(times[i]))
        return counts, cached

    def _set_refcounts(self, pages: np.ndarray, before: np.ndarray, after: np.ndarray, cached: np.ndarray) -> None:
        """refcount[pages] (distinct, valid; now `before`, cached flags `cached`) = after,
        keeping num_reclaimable."""
        self._reclaimable += int(np.count_nonzero(cached & (after == 1)) - np.count_nonzero(cached & (before == 1)))
        self._refcounts[pages] = after

    # ---- a few pages: one at a time ----------------------------------------------------
    def _incref_each(self, pages: list[int]) -> None:
        for page in pages:
            self._check_id(page)
            if self._refcounts.item(page) == 0:
                raise ValueError(f"incref of free page {page}")
        for page in pages:
            self._set_refcount(page, self._refcounts.item(page) + 1)

    def _free_each(self, pages: list[int]) -> list[int]:
        releases = Counter(pages)
        for page, times in releases.items():
            self._check_free_one(page, times)
        released = []
        for page, times in releases.items():
            count = self._refcounts.item(page) - times
            self._set_refcount(page, count)
            if count == 0:
                self._free_list.append(page)
                released.append(page)
        return released

    def _check_free_one(self, page: int, times: int) -> None:
        self._check_id(page)
        count = self._refcounts.item(page)
        if times > count:
            raise ValueError(f"double free of page {page}: refcount {count}, freed {times} times")
        if self._cached.item(page) and times >= count:
            raise ValueError(f"free of page {page} would drop the prefix cache's reference "
                             f"(refcount {count}, freed {times} times): use uncache")

    def _set_refcount(self, page: int, count: int) -> None:
        if self._cached.item(page):
            self._reclaimable += (count == 1) - (self._refcounts.item(page) == 1)
        self._refcounts[page] = count

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page} outside [0, {self.num_pages})")
