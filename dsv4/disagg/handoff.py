"""A request handed from a prefill engine to a decode engine, engine side (docs/architecture.md,
"Disaggregation").

Prefill: the engine computes prompt[:-1] (max_tokens 1); when that request finishes, before its
cache is released (`Scheduler.on_finish`), `Exporter` packs its state at L = len(prompt) - 1
(history pages + continuation block, disagg/state.py) into host bytes. The engine then releases
its pages as for any finished request (the prefix tree keeps the shareable ones): a prefill
engine holds no page for a request waiting to be pulled, only its bytes.

Decode: `Importer.begin` adds the request and takes it out of the scheduler's queue; `reserve`
holds what positions [L, L + 1) need (all history pages, the window's SWA pages, a slot) before
any byte moves, sharing the pages of its own prefix-cache hit (only the pages after it are
fetched); `finish` writes the pulled bytes into those pages and runs the request from L (its
first step computes the last prompt token and samples the first output token, so sampling is
the colocated engine's). `drop` gives everything back (a failed or aborted transfer).
"""
from __future__ import annotations

import torch

from ..cache.layout import PAGE_TOKENS
from .state import StateCodec, StateHeader, StateMismatch


class Exporter:
    """Prefill side: request id -> (header, bytes) of the requests marked for export."""

    def __init__(self, engine):
        self.engine = engine
        self.codec = StateCodec(engine.runner.storage)
        self.wanted: dict[str, int] = {}        # request id -> first history page to send
        self.ready: dict[str, tuple[StateHeader, bytes]] = {}
        engine.scheduler.on_finish = self._on_finish

    def _on_finish(self, req) -> None:
        first = self.wanted.pop(req.request_id, None)
        if first is None:
            return
        L = len(req.prompt_token_ids)
        held = self.engine.cache.seqs[req.request_id]
        with torch.inference_mode():
            self.ready[req.request_id] = self.codec.export(held.pages, held.swa_pages, held.slot, L,
                                                           min(first, -(-L // PAGE_TOKENS)))


class Importer:
    """Decode side: requests whose state is being pulled, with their reservations held."""

    def __init__(self, engine):
        self.engine = engine
        self.codec = StateCodec(engine.runner.storage)
        self.held: dict[str, object] = {}        # request id -> Request (reserved, in no queue)

    def begin(self, request_id: str, prompt_ids: list[int], params) -> object:
        """Add the request (ValueError for a bad one) and park it outside the scheduler."""
        req = self.engine.add_request(request_id, prompt_ids, params)
        self.engine.scheduler.waiting.remove(req)
        self.held[request_id] = req
        return req

    def reserve(self, req) -> int | None:
        """Hold positions [L, L + 1) (L = prompt - 1), sharing the history pages of this
        engine's own prefix-cache hit; the first history page to fetch, or None while pages
        are short (nothing held then)."""
        L, cache = len(req.prompt_token_ids) - 1, self.engine.cache
        hit = cache.match(req)
        if hit is not None and not cache.admit(req, hit, 1):
            return None
        req.num_computed = L
        if not cache.reserve(req, 1):
            cache.release(req)
            req.num_computed = 0
            return None
        start = hit.length if hit is not None else 0
        req.num_cached_tokens = start
        sched = self.engine.scheduler
        if cache.prefix is not None:
            sched.prefix_queries += req.num_tokens
            sched.prefix_hits += start
        return start // PAGE_TOKENS

    def finish(self, req, header: StateHeader, data: bytes) -> None:
        """Install the pulled state and run the request from L (StateMismatch: nothing changed
        but the bytes written into its own reserved pages; the caller drops it)."""
        L = len(req.prompt_token_ids) - 1
        if header.length != L:
            raise StateMismatch(f"state at {header.length}, the request resumes at {L}")
        held = self.engine.cache.seqs[req.request_id]
        with torch.inference_mode():
            self.codec.install(header, data, held.pages, held.swa_pages, held.slot)
        del self.held[req.request_id]
        self.engine.scheduler.waiting.append(req)
        self.engine.scheduler.run_now(req)

    def drop(self, request_id: str) -> None:
        """Release a parked request and everything it reserved."""
        if self.held.pop(request_id, None) is not None:
            self.engine.abort(request_id)
