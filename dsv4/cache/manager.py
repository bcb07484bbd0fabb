"""Which pages and state slot each request holds (docs/architecture.md, "Cache").

The manager owns the per-request records (`SeqCache`, keyed by request id); requests hold
nothing of the cache. A request running a step over positions [n, n + k) must hold:
  * history pages for logical pages 0 .. (n + k - 1) // 256;
  * SWA pages for logical pages from (n - W - S) // 128 to (n + k - 1) // 128 (older ones
    are freed after each step: positions below n - W - S are never read again);
  * a state slot (its compressor ring rows).
`reserve` takes all of it or nothing. A request is anything with `request_id` and
`num_computed` (tokens whose KV is written).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout, CachePlan
from .pages import PageAllocator


@dataclass
class SeqCache:
    pages: list[int] = field(default_factory=list)       # logical 256-token page -> physical
    swa_pages: list[int] = field(default_factory=list)   # logical 128-token SWA page -> physical or -1
    slot: int | None = None                              # request state slot: its ring rows

    @property
    def holds_nothing(self) -> bool:
        return not self.pages and not any(p >= 0 for p in self.swa_pages) and self.slot is None


class CacheManager:
    def __init__(self, layout: CacheLayout, plan: CachePlan):
        self.layout, self.plan = layout, plan
        self.pages = PageAllocator(plan.num_pages)
        self.swa = PageAllocator(plan.num_swa_pages)
        self.free_slots = list(range(plan.max_num_seqs - 1, -1, -1))
        self.seqs: dict[str, SeqCache] = {}

    def seq(self, req) -> SeqCache:
        """The request's record (an empty one, not stored, when it holds nothing)."""
        return self.seqs.get(req.request_id) or SeqCache()

    def _needs(self, req, num_new: int) -> tuple[int, list[int]]:
        held = self.seq(req)
        end = req.num_computed + num_new
        history = max(0, -(-end // PAGE_TOKENS) - len(held.pages))
        first = max(0, req.num_computed - self.layout.swa_keep) // SWA_PAGE_TOKENS
        last = (end - 1) // SWA_PAGE_TOKENS
        swa = [p for p in range(first, last + 1) if p >= len(held.swa_pages) or held.swa_pages[p] < 0]
        return history, swa

    def can_reserve(self, req, num_new: int) -> bool:
        history, swa = self._needs(req, num_new)
        return (self.pages.can_allocate(history) and self.swa.can_allocate(len(swa))
                and (self.seq(req).slot is not None or bool(self.free_slots)))

    def reserve(self, req, num_new: int) -> bool:
        """Hold everything positions [num_computed, num_computed + num_new) need; all or nothing."""
        if not self.can_reserve(req, num_new):
            return False
        history, swa = self._needs(req, num_new)
        held = self.seqs.setdefault(req.request_id, SeqCache())
        if held.slot is None:
            held.slot = self.free_slots.pop()
        held.pages.extend(self.pages.allocate(history))
        for logical, phys in zip(swa, self.swa.allocate(len(swa))):
            held.swa_pages.extend([-1] * (logical + 1 - len(held.swa_pages)))
            held.swa_pages[logical] = phys
        return True

    def trim(self, req) -> None:
        """Free SWA pages wholly below num_computed - W - S."""
        held = self.seqs.get(req.request_id)
        if held is None:
            return
        keep_from = max(0, req.num_computed - self.layout.swa_keep) // SWA_PAGE_TOKENS
        self.swa.free([p for p in held.swa_pages[:keep_from] if p >= 0])
        held.swa_pages[:keep_from] = [-1] * min(keep_from, len(held.swa_pages))

    def release(self, req) -> None:
        """Free everything the request holds (finish, abort, preemption)."""
        held = self.seqs.pop(req.request_id, None)
        if held is None:
            return
        self.pages.free(held.pages)
        self.swa.free([p for p in held.swa_pages if p >= 0])
        if held.slot is not None:
            self.free_slots.append(held.slot)

    def fits_ever(self, num_tokens: int, chunk: int) -> bool:
        """Could a request of `num_tokens` tokens run alone (chunks of `chunk` tokens)?"""
        swa_needed = self.layout.swa_pages_needed(1, chunk)
        return -(-num_tokens // PAGE_TOKENS) <= self.plan.num_pages and swa_needed <= self.plan.num_swa_pages

    def usage(self) -> dict:
        return {"pages_used": self.pages.num_used, "pages_total": self.plan.num_pages,
                "swa_pages_used": self.swa.num_used, "swa_pages_total": self.plan.num_swa_pages,
                "slots_used": self.plan.max_num_seqs - len(self.free_slots)}
