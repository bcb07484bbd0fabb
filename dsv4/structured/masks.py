"""A step's token bitmask, built on the host (xgrammar's layout: int32 words, bit t % 32 of word
t // 32 set = token t allowed) for the rows that have a grammar; rows without one are not in
it and cost nothing. The sampler applies it as one masked fill (engine/sampler.py), ANDed there
with the special-token filter (`GrammarMask.keep`), so the host never touches the words again.

Decode steps go through `MaskFiller` (docs/architecture.md, "Structured outputs"): the matchers
take the previous step's tokens in one xgrammar batch call, then the rows are filled into one
preallocated buffer by a single xgrammar batch call, which releases the GIL, on a worker thread,
so the engine's host work runs on the main thread meanwhile; `PendingMask.result()` joins it,
or fills on the calling thread if the worker never picked the fill up (a busy host): the worst
case is an inline fill. The worker's job is that one call and nothing else: Python on the worker
between two GIL-free calls would wait for the main thread to let go of the GIL (up to a whole
switch interval while it runs pure Python)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .matcher import RequestGrammar

# Fewer constrained rows than this are filled on the calling thread: handing the work to the
# worker and back costs about as much as filling a handful of rows.
THREAD_MIN_ROWS = 8
# Threads of xgrammar's own pool for one batch fill (the call still blocks its caller). One: on a
# 2-core host, 2 threads made a 64-row fill of a cheap state 1.2 ms instead of 26 us (the pool's
# threads start per call); the fill overlaps the main thread's work anyway. Unmeasured on a GPU host.
FILL_THREADS = 1
# How long `start` waits for the worker to pick a fill up before going on (its GIL hand-off needs
# the OS to run the worker thread); a fill still not picked up by `result()` is done there.
HANDOFF_WAIT_S = 2e-4


@dataclass
class GrammarMask:
    rows: torch.Tensor        # [R] long: the sampling rows the mask applies to
    bitmask: torch.Tensor     # [R, ceil(V / 32)] int32
    covers_all: bool = False  # rows == 0..R-1 are every row of the batch: masked in place
    keep: torch.Tensor | None = None   # [ceil(V / 32)] int32 ANDed into every row (special tokens)


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class PendingMask:
    """A mask whose rows may still be being filled on the worker thread."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor, keep: torch.Tensor | None,
                 covers_all: bool, filling: Future | None = None, fill: Callable[[], None] | None = None):
        """filling: the worker's future of `fill` (None: already filled)."""
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.bitmask, self.keep, self.covers_all = bitmask, keep, covers_all
        self.filling, self.fill = filling, fill

    def result(self) -> GrammarMask:
        """Wait for the fill (re-raising its error), or do it here if the worker has not begun
        it. The bitmask is a view of the filler's buffer, valid until its next `start`."""
        if self.filling is not None:
            if self.filling.cancel():
                self.fill()
            else:
                self.filling.result()
            self.filling = None
        return GrammarMask(self.rows, self.bitmask, self.covers_all, self.keep)


class MaskFiller:
    """The masks of decode steps, one at a time, into a buffer reused from step to step (grown
    to the largest batch seen). Created with the engine's grammars (`registry.Grammars`)."""

    def __init__(self, vocab_size: int, keep: torch.Tensor | None):
        import xgrammar
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=FILL_THREADS)   # one C++ call for all rows
        self.keep, self.width = keep, words(vocab_size)
        self.thread_min_rows = THREAD_MIN_ROWS     # (benchmarks/structured_output.py compares both ways)
        self.buffer = torch.empty(0, self.width, dtype=torch.int32)
        self._worker: ThreadPoolExecutor | None = None     # started by the first threaded fill
        self._filling: Future | None = None                # the worker's last fill

    def idle(self) -> None:
        """Wait for a fill still running (one whose step failed before its `result()`): the
        buffer and the matchers are free afterwards. Its error, if any, was the step's."""
        if self._filling is not None:
            if not self._filling.cancel():
                self._filling.exception()
            self._filling = None

    @torch.inference_mode()
    def start(self, grammars: list[RequestGrammar | None],
              taken: list[tuple[RequestGrammar, int]] = ()) -> PendingMask | None:
        """One entry per sampling row (None: unconstrained) -> the pending mask of the rows
        whose grammar constrains the next token, or None when there is none. `taken`: the
        previous step's (grammar, token) pairs, a grammar at most once, accepted first (one
        batch call). The matchers must not change until `result()` returns."""
        self.idle()
        accept_batch(taken)
        rows, live, ended, matchers = [], [], [], []     # (live, ended: positions in rows)
        for i, g in enumerate(grammars):
            if g is None or not g.constrains:
                continue
            if g.ended:
                ended.append(len(rows))
            else:
                live.append(len(rows))
                matchers.append(g.matcher)
            rows.append(i)
        if not rows:
            return None
        if self.buffer.shape[0] < len(rows):
            self.buffer = torch.empty(max(len(rows), 2 * self.buffer.shape[0]), self.width, dtype=torch.int32)
        bitmask = self.buffer[:len(rows)]
        for n in ended:
            grammars[rows[n]].fill(bitmask, n)            # EOS only: xgrammar refuses to fill it

        def fill() -> None:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask, live)

        covers_all = len(rows) == len(grammars)
        if len(live) >= self.thread_min_rows:
            return PendingMask(rows, bitmask, self.keep, covers_all, self._fill_on_worker(fill), fill)
        if live:
            fill()
        return PendingMask(rows, bitmask, self.keep, covers_all)

    def _fill_on_worker(self, fill: Callable[[], None]) -> Future:
        """Hand `fill` to the worker and give it up to HANDOFF_WAIT_S to begin: it needs the GIL
        to start, which the caller's pure-Python work would otherwise hold for up to a whole
        switch interval. The worker gives the GIL back inside xgrammar's call."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-grammar-masks")
        started = threading.Event()

        def run() -> None:
            started.set()
            fill()

        self._filling = self._worker.submit(run)
        started.wait(HANDOFF_WAIT_S)
        return self._filling

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def verify_mask(grammars: list[tuple[RequestGrammar | None, list[int]]], vocab_size: int,
                keep: torch.Tensor | None = None) -> GrammarMask | None:
    """Per verify chunk (its grammar, its drafts), in row order: len(drafts) + 1 rows each, row j
    masked as after drafts[:j] (the matcher is rolled back after). Filled on the calling
    thread: speculative steps run synchronously."""
    total = sum(len(d) + 1 for g, d in grammars if g is not None)
    if total == 0:
        return None
    bitmask = torch.empty(total, words(vocab_size), dtype=torch.int32)
    rows, used, first = [], 0, 0
    for g, drafts in grammars:
        if g is not None:
            masked = g.fill_drafts(bitmask, used, drafts)
            rows += [first + j if m else -1 for j, m in enumerate(masked)]
            used += len(drafts) + 1
        first += len(drafts) + 1
    keep_rows = [n for n, r in enumerate(rows) if r >= 0]
    if not keep_rows:
        return None
    return GrammarMask(torch.tensor([rows[n] for n in keep_rows], dtype=torch.long), bitmask[keep_rows], keep=keep)


def accept_batch(taken: list[tuple[RequestGrammar, int]]) -> None:
    """A step's (grammar, token) pairs, a grammar at most once: the `</think>` gates take theirs
    (`RequestGrammar.take_gate`), the matchers the rest in one xgrammar call. That call's per-row
    results are not read back (an element at a time, that costs as much as the call: xgrammar's
    own wrapper does): a refused token leaves its matcher as it was, and only the stop token can
    end one (`RequestGrammar.took`)."""
    matchers, tokens, stops = [], [], []
    for g, t in taken:
        if g.take_gate(t):
            matchers.append(g.matcher)
            tokens.append(t)
            if t == g.stop_id:
                stops.append(g)
    if matchers:
        _batch_accept(matchers, tokens)
    for g in stops:
        g.took(g.stop_id)


def _batch_accept(matchers: list, tokens: list[int]) -> None:
    """xgrammar's batch accept without reading its results back, through its private core (the
    installed 0.2.9 has it); xgrammar's public call if a release moves those internals."""
    try:
        from xgrammar.base import _core
        handles = [m._handle for m in matchers]
    except (ImportError, AttributeError):
        import xgrammar
        xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return
    _core.BatchGrammarMatcher.batch_accept_token(handles, tokens, False)
