"""A step's token bitmask, built on the host (xgrammar's layout: int32 words, bit t % 32 of word
t // 32 set = token t allowed) for the rows that have a grammar; rows without one are not in
it and cost nothing. The sampler applies it as one masked fill (engine/sampler.py), ANDed there
with the special-token filter (`GrammarMask.keep`), so the host never touches the words again.

Decode steps go through `MaskFiller` (docs/architecture.md, "Structured outputs"): the gates
take the previous step's tokens on the calling thread, then each of `FILL_THREADS` persistent
threads (structured/fill_threads.py) takes a slice of the rows: its matchers accept their tokens
(one xgrammar batch call) and fill their rows of one preallocated buffer (another); both calls
release the GIL, so the engine's host work runs on the main thread meanwhile.
`PendingMask.result()` joins them, running on the calling thread a slice whose thread never
picked it up (a busy host): the worst case is an inline accept and fill."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .fill_threads import FillThreads, Job
from .matcher import RequestGrammar

# Fewer constrained rows than this are filled on the calling thread, and a fill thread gets at
# least this many: handing the work to a thread and back costs about as much as a handful of rows.
THREAD_MIN_ROWS = 8
# Threads that fill a step's rows, a slice each (one xgrammar call, its own pool off: that pool
# starts its threads on every call). A quarter of the cores this process may use, at most 2, at
# least 1: the main thread, the GPU's launches and the API process need the rest (on a 16-core
# H200 host 2 threads beat 4: 0.84x against 0.77x of unconstrained decode, docs/benchmarks.md).
FILL_THREADS = min(2, max(1, len(os.sched_getaffinity(0)) // 4 if hasattr(os, "sched_getaffinity")
                          else (os.cpu_count() or 1) // 4))
# How long `start` waits for the threads to begin their slices before going on (each needs the
# GIL to start, which the caller's pure-Python work would otherwise hold for up to a whole switch
# interval); a slice still not begun by `result()` is filled there.
HANDOFF_WAIT_S = 5e-4


@dataclass
class GrammarMask:
    rows: torch.Tensor        # [R] long: the sampling rows the mask applies to
    bitmask: torch.Tensor     # [R, ceil(V / 32)] int32
    covers_all: bool = False  # rows == 0..R-1 are every row of the batch: masked in place
    keep: torch.Tensor | None = None   # [ceil(V / 32)] int32 ANDed into every row (special tokens)
    keep_bits: torch.Tensor | None = None   # [ceil(V / 32), 32] int32 `keep_bits(keep)` (made once, on the device)
    page_locked: bool = False  # bitmask lies in page-locked host memory: copied to the GPU as it is


def bit_selectors(device) -> torch.Tensor:
    """[32] int32: word b has bit b alone set (bit 31: -2**31)."""
    return 1 << torch.arange(32, dtype=torch.int32, device=device)


def keep_bits(keep: torch.Tensor | None, device) -> torch.Tensor:
    """[ceil(V / 32), 32] int32: keep[w] & (1 << b) at [w, b] (`keep` None: [32], every bit):
    `(bitmask[:, :, None] & keep_bits) != 0` says which tokens a row allows, `keep` ANDed in."""
    bits = bit_selectors(device)
    return bits if keep is None else keep[:, None] & bits


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class PendingMask:
    """A mask whose rows may still be being filled on the fill threads."""

    def __init__(self, rows: torch.Tensor, bitmask: torch.Tensor, keep: torch.Tensor | None,
                 covers_all: bool, filling: list[Job] = (), filler: MaskFiller | None = None):
        """rows: [R] long; filling: the fill threads' jobs (none: already filled); filler: whose
        `taken_back` counts the jobs `result()` runs itself."""
        self.rows, self.bitmask, self.keep, self.covers_all = rows, bitmask, keep, covers_all
        self.filling, self.filler = filling, filler

    def result(self) -> GrammarMask:
        """Wait for the fill (re-raising its error), doing here any slice no thread has begun.
        The bitmask is a view of the filler's buffer, valid until its next `start`."""
        if self.filling:
            jobs, self.filling = self.filling, ()
            self.filler.taken_back += sum(job.join() for job in jobs)
            if self.filler.pending is jobs:
                self.filler.pending = []
        return GrammarMask(self.rows, self.bitmask, self.covers_all, self.keep)


class MaskFiller:
    """The masks of decode steps, one at a time, into a buffer reused from step to step (grown
    to the largest batch seen). Created with the engine's grammars (`registry.Grammars`)."""

    def __init__(self, vocab_size: int, keep: torch.Tensor | None, threads: int | None = None):
        """threads: fill threads (None: FILL_THREADS)."""
        self.keep, self.width = keep, words(vocab_size)
        self.thread_min_rows = THREAD_MIN_ROWS     # (benchmarks/structured_output.py compares both ways)
        self.buffer = torch.empty(0, self.width, dtype=torch.int32)
        self.all_rows = torch.arange(0)            # rows 0..R-1 of a mask that covers every row
        self.threads = FillThreads(threads or FILL_THREADS, "dsv4-grammar-masks")   # started by the first threaded fill
        self.batches = [_batch_matcher() for _ in range(self.threads.n)]    # one per thread (the inline fill: 0)
        self.pending: list[Job] = []               # the threads' jobs of the last fill, until joined
        self.slices = self.taken_back = 0          # slices handed to the threads; of them, run by `result()`

    def idle(self) -> None:
        """Finish a fill not joined (one whose step failed before its `result()`; a slice not
        begun runs here: its matchers' accept must not be lost): the buffer and the matchers are
        free afterwards. Its error, if any, was the step's."""
        for job in self.pending:
            job.settle()
        self.pending = []

    @torch.inference_mode()
    def start(self, grammars: list[RequestGrammar | None],
              taken: list[tuple[RequestGrammar, int]] = ()) -> PendingMask | None:
        """One entry per sampling row (None: unconstrained) -> the pending mask of the rows
        whose grammar constrains the next token, or None when there is none. `taken`: the
        previous step's (grammar, token) pairs, a grammar at most once, accepted first: by the
        fill threads, each for its slice's rows, right before their fill (`owed_tokens`). The
        matchers must not change until `result()` returns."""
        self.idle()
        owed = owed_tokens(taken)
        rows, live, ended, matchers, tokens = [], [], [], [], []   # (live, ended: positions in rows)
        for i, g in enumerate(grammars):
            if g is None or not g.constrains:
                continue
            if g.ended:
                ended.append(len(rows))
            else:
                live.append(len(rows))
                matchers.append(g.matcher)
                tokens.append(owed.pop(g, None))       # (owed tokens come only from open gates)
            rows.append(i)
        if owed:                                       # grammars not in this step: accepted here
            _batch_accept([g.matcher for g in owed], list(owed.values()))
        if not rows:
            return None
        bitmask = self._rows(len(rows))
        for n in ended:
            grammars[rows[n]].fill(bitmask, n)            # EOS only: xgrammar refuses to fill it
        covers_all = len(rows) == len(grammars)
        rows_t = self.all_rows[:len(rows)] if covers_all else torch.tensor(rows, dtype=torch.long)
        slices = min(self.threads.n, len(live) // self.thread_min_rows)
        if slices == 0:
            if live:
                accept, fill = self._slice(0, matchers, tokens, bitmask, live, 1)
                accept()
                fill()
            return PendingMask(rows_t, bitmask, self.keep, covers_all)
        accepts, fills = zip(*[self._slice(k, matchers, tokens, bitmask, live, slices) for k in range(slices)])
        self.pending = self.threads.submit(list(fills), HANDOFF_WAIT_S, firsts=list(accepts))
        self.slices += slices
        return PendingMask(rows_t, bitmask, self.keep, covers_all, self.pending, self)

    def _rows(self, n: int) -> torch.Tensor:
        """The first n rows of the reused buffer (grown, with `all_rows`, when short)."""
        if self.buffer.shape[0] < n:
            size = max(n, 2 * self.buffer.shape[0])
            self.buffer = torch.empty(size, self.width, dtype=torch.int32)
            self.all_rows = torch.arange(size)
        return self.buffer[:n]

    def _slice(self, k: int, matchers: list, tokens: list[int | None], bitmask: torch.Tensor, live: list[int],
               slices: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """Slice k of `slices` near-equal contiguous slices of the live rows -> (its matchers
        accept their owed tokens (`tokens`, None: none), then fill their rows): an xgrammar call
        each. On a fill thread the accept runs before the job counts as begun
        (fill_threads.Job), so the caller's hand-off wait covers it."""
        lo, hi = k * len(live) // slices, (k + 1) * len(live) // slices
        part, at, batch = matchers[lo:hi], live[lo:hi], self.batches[k]
        owing = [(m, t) for m, t in zip(part, tokens[lo:hi]) if t is not None]
        accepting, accepted = [m for m, _ in owing], [t for _, t in owing]

        def accept() -> None:
            if accepting:
                _batch_accept(accepting, accepted)
        return accept, lambda: batch.batch_fill_next_token_bitmask(part, bitmask, at)

    def close(self) -> None:
        self.idle()
        self.threads.close()


def _batch_matcher():
    import xgrammar
    return xgrammar.BatchGrammarMatcher(max_threads=1)     # (its own pool would start threads per call)


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


def owed_tokens(taken: list[tuple[RequestGrammar, int]]) -> dict[RequestGrammar, int]:
    """A step's (grammar, token) pairs, a grammar at most once: the `</think>` gates take theirs
    (`RequestGrammar.take_gate`) -> the rest, by grammar, for the matchers to accept (the fill
    threads do). With a stop token among them, which may end its grammar (`RequestGrammar.took`)
    and so change which rows are filled, every token is accepted here (`accept_batch`) and none
    is owed."""
    owed = {g: t for g, t in taken if g.take_gate(t)}
    if any(t == g.stop_id for g, t in owed.items()):
        accept_batch(owed)
        return {}
    return owed


def accept_batch(owed: dict[RequestGrammar, int]) -> None:
    """The matchers accept their tokens in one xgrammar call. That call's per-row results are not
    read back (an element at a time, that costs as much as the call: xgrammar's own wrapper does):
    a refused token leaves its matcher as it was, and only the stop token can end one
    (`RequestGrammar.took`)."""
    _batch_accept([g.matcher for g in owed], list(owed.values()))
    for g, t in owed.items():
        if t == g.stop_id:
            g.took(t)


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
