"""Continuous batching with chunked prefill (docs/architecture.md, "Engine").

Each step: running requests first (decodes, then unfinished prefills, oldest first), then
waiting ones in arrival order, under `max_num_batched_tokens` and `max_num_seqs`. A decode
with drafts (`Request.spec_token_ids`) is one verify chunk of its last token and the drafts
(as many as the budget allows). A
request is scheduled only once the cache manager has reserved what its chunk needs. When a
running request cannot get pages, the newest running request is preempted by recompute
(everything it held is freed; it re-enters the front of the waiting queue) until it fits.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..cache.manager import CacheManager
from .request import Request, Status


@dataclass
class ScheduledChunk:
    """Tokens [num_computed, num_computed + num_tokens) of a request in this step: a prefill
    chunk, one decode token, or k + 1 tokens to verify (the last known token and k drafts,
    `num_logits` = k + 1: the last rows whose logits the step returns; by default the last row
    when the chunk completes). `num_rejected`: trailing verify positions whose drafts were
    rejected; the step writes them but counts them as not computed (invariant 1)."""
    request: Request
    num_tokens: int
    num_logits: int | None = None
    num_rejected: int = 0

    @property
    def completes(self) -> bool:
        """The chunk reaches the last known token (and maybe drafts past it), so new tokens are
        sampled after it."""
        return self.request.num_computed + self.num_tokens >= self.request.num_tokens


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.cache = cache
        self.max_tokens, self.max_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        order = sorted(self.running, key=lambda r: (not r.is_decoding, r.arrival))
        for req in order:
            budget = self.max_tokens - sum(c.num_tokens for c in chunks)
            if budget == 0 or req.status is not Status.RUNNING:
                continue
            drafts = len(req.spec_token_ids) if req.is_decoding else 0
            n = min(req.num_remaining + drafts, budget)
            if self._reserve_or_preempt(req, n, chunks):
                chunks.append(ScheduledChunk(req, n, n if drafts else None))
        budget = self.max_tokens - sum(c.num_tokens for c in chunks)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            req = self.waiting[0]
            n = min(req.num_remaining, budget)
            if not self.cache.reserve(req, n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        return chunks

    def _reserve_or_preempt(self, req: Request, n: int, scheduled: list[ScheduledChunk]) -> bool:
        """Reserve for `req`, preempting the newest running request (even one already scheduled
        this step: its chunk is withdrawn) until it fits; False if `req` itself was newest."""
        while not self.cache.reserve(req, n):
            victim = max((r for r in self.running if r is not req), key=lambda r: r.arrival, default=None)
            if victim is None or victim.arrival < req.arrival:
                victim = req
            self.preempt(victim)
            scheduled[:] = [c for c in scheduled if c.request is not victim]
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        self.cache.release(req)
        self.running.remove(req)
        req.status, req.num_computed = Status.WAITING, 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: Status = Status.FINISHED) -> None:
        """Remove a request wherever it is and free everything it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req)
        req.status = status
