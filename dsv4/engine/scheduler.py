"""Continuous batching with chunked prefill (docs/architecture.md, "Engine").

Each step: running requests first (decodes, then unfinished prefills, oldest first), then
waiting ones in arrival order, under `max_num_batched_tokens` and `max_num_seqs`. A decode
with drafts (`Request.spec_token_ids`) is one verify chunk of its last token and the drafts
(as many as the budget allows). A
request is scheduled only once the cache manager has reserved what its chunk needs. When a
running request cannot get pages, the newest running request is preempted by recompute
(everything it held is freed; it re-enters the front of the waiting queue) until it fits.

With a prefix cache (docs/architecture.md, "Cache"):
  * admission first looks for a hit: the request resumes at the hit's page boundary, its
    matched pages cost no new pages, and its chunk is what is left after them;
  * a waiting request whose prompt another running request is still prefilling waits for it
    (n > 1 and parallel copies of one prompt then share its pages and checkpoint);
  * a waiting request whose deeper prefix the host / disk tiers are restoring waits for it.

A request whose grammar still compiles (`Request.grammar_pending`, docs/architecture.md,
"Structured outputs") is passed over until the engine has its grammar: left waiting, or, run
at once by a disaggregated import (disagg/handoff.py), given no chunk.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter

from ..cache.layout import PAGE_TOKENS
from ..cache.manager import CacheManager
from ..model.vision.spans import atomic_chunk
from .request import Request, Status


_ARRIVAL = attrgetter("arrival")      # sort key: admission order
_REQUEST = attrgetter("request")


@dataclass(slots=True)     # (made per request and step: no instance dict)
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
    def __init__(self, cache: CacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_prompt_logprobs_tokens: int | None = None):
        """max_prompt_logprobs_tokens: the prompt positions of all chunks computing prompt
        logprobs in one step (every row of such a chunk has logits); None: the token budget."""
        self.cache = cache
        self.max_tokens, self.max_seqs = max_num_batched_tokens, max_num_seqs
        self.max_logprob_rows = max_prompt_logprobs_tokens or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_queries = 0      # tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0         # of them, tokens resumed from it
        # called with a request that finished normally, before its cache is released (a
        # disaggregated prefill engine exports its state there: dsv4/disagg/prefill.py)
        self.on_finish = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        self.cache.poll_tiers()
        chunks: list[ScheduledChunk] = []
        running = Status.RUNNING
        decoding = [r.status is running and r.num_remaining == 1 for r in self.running]
        # decodes first, then the others, each oldest first (two stable sorts by arrival: the
        # order of one sort by (not decoding, arrival), without a Python key call a request)
        order = sorted(compress(self.running, decoding), key=_ARRIVAL)
        num_decoding = len(order)
        order += sorted(compress(self.running, [not d for d in decoding]), key=_ARRIVAL)
        used = 0                    # tokens of `chunks` (kept as a sum: O(1) a request)
        for i, req in enumerate(order):
            budget = self.max_tokens - used
            if budget <= 0 or req.status is not running or req.grammar_pending:   # < 0: an image block ran over
                continue            # (pending: a disaggregated import runs its request at once)
            # tokens left: a preemption earlier in this loop only touches its victim (no longer RUNNING)
            left = 1 if i < num_decoding else req.num_remaining
            drafts = len(req.spec_token_ids) if left == 1 else 0     # decoding: RUNNING, one token left
            n = min(left + drafts, budget)
            if req.params.prompt_logprobs is not None and req.num_computed < len(req.prompt_token_ids):
                n = min(n, self._logprob_rows_left(chunks))
                if not n:
                    continue
            if req.images:
                n = atomic_chunk(req.images, req.num_computed, n)
            before = len(chunks)
            if self.cache.reserve(req, n) or self._reserve_or_preempt(req, n, chunks):
                chunks.append(ScheduledChunk(req, n, n if drafts else None))
            # a preemption may have withdrawn chunks: count again then
            used = used + n if len(chunks) == before + 1 else sum(c.num_tokens for c in chunks)
        budget = self.max_tokens - used
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_seqs:
            req = self.waiting[i]
            rows = self._logprob_rows_left(chunks) if req.params.prompt_logprobs is not None else budget
            if req.grammar_pending or not rows or self._waits_for_twin(req) or self.cache.waits_for_tiers(req):
                i += 1
                continue
            n = self._admit(req, min(budget, rows))
            if not n:
                break
            del self.waiting[i]
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        return chunks

    def _logprob_rows_left(self, chunks: list[ScheduledChunk]) -> int:
        """Prompt positions a chunk computing prompt logprobs may still have in this step (only
        requests asking for them pay this pass over the step's chunks)."""
        return max(self.max_logprob_rows - sum(c.num_tokens for c in chunks if c.request.params.prompt_logprobs
                                               is not None and c.request.num_computed < len(c.request.prompt_token_ids)),
                   0)

    def _admit(self, req: Request, budget: int) -> int:
        """Reserve the first chunk of a waiting request, resuming from a prefix hit when there
        is one; its size, or 0 when it does not fit."""
        hit = self.cache.match(req)
        start = hit.length if hit is not None else 0
        n = atomic_chunk(req.images, start, min(req.num_tokens - start, budget))
        if not (self.cache.admit(req, hit, n) if hit is not None else self.cache.reserve(req, n)):
            return 0
        if self.cache.prefix is not None:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += start
        if req.num_cached_tokens is None:
            req.num_cached_tokens = start
        return n

    def _waits_for_twin(self, req: Request) -> bool:
        """Another running request with the same prompt has not yet reached the page boundary
        this one would resume from: it waits, to share that prefill."""
        if self.cache.prefix is None or req.num_computed or req.wants_prompt_logprobs:
            return False
        boundary = (len(req.prompt_token_ids) - 1) // PAGE_TOKENS * PAGE_TOKENS
        return boundary > 0 and any(r.num_computed < boundary and r.prompt_token_ids == req.prompt_token_ids
                                    for r in self.running)

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

    def advance(self, req: Request, num_tokens: int) -> None:
        """After a step wrote `num_tokens` more positions of `req`: share what it completed with
        the prefix cache (checkpointing the page boundary it reached), then free SWA pages
        behind its window."""
        req.num_computed += num_tokens
        self.cache.commit(req)
        self.cache.trim(req)

    def advance_step(self, chunks: list[ScheduledChunk]) -> None:
        """`advance` each chunk's request of a launched step by its tokens less its rejected
        ones: num_computed in one pass, then the cache's commits and trims (CacheManager.settle)."""
        reqs = list(map(_REQUEST, chunks))
        for req, c in zip(reqs, chunks):
            req.num_computed += c.num_tokens - c.num_rejected
        self.cache.settle(reqs)

    def preempt(self, req: Request) -> None:
        self.cache.release(req)
        self.running.remove(req)
        req.status, req.num_computed, req.batch_row = Status.WAITING, 0, -1     # (leaves the persistent batch)
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: Status = Status.FINISHED) -> None:
        """Remove a request wherever it is and free everything it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if status is Status.FINISHED and self.on_finish is not None:
            self.on_finish(req)
        self.cache.release(req)
        req.status, req.batch_row = status, -1      # (leaves the persistent batch: engine/slot_state.py)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.running), len(self.waiting)

    def run_now(self, req: Request) -> None:
        """Move a waiting request whose cache the caller has reserved straight to running."""
        self.waiting.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)

    @contextmanager
    def only(self, req: Request):
        """Inside: the scheduler sees `req` alone, running or waiting as it was. After: the
        others are back, and `req` is wherever the steps inside left it."""
        running, waiting = self.running, self.waiting
        was_waiting = req in waiting
        self.running, self.waiting = ([], deque([req])) if was_waiting else ([req], deque())
        try:
            yield
        finally:
            solo_running, solo_waiting = self.running, self.waiting
            self.running, self.waiting = running, waiting
            (waiting if was_waiting else running).remove(req)
            if req in solo_running:
                running.append(req)
            elif req in solo_waiting:
                waiting.appendleft(req)      # not admitted, or preempted
