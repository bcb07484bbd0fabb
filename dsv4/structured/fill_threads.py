"""Persistent threads for the GIL-free part of a step's mask fill: each runs xgrammar batch calls on
a slice of the step's rows (docs/architecture.md, "Structured outputs").

xgrammar's own multi-threaded batch fill starts its threads on every call (two clones a call for
two threads); these start once. A thread runs nothing but its job between two blocking waits
(the queue's `get`, a lock): Python on it must hold the GIL, which the main thread's pure-Python
work keeps for up to a whole switch interval. So a job's GIL-free calls are all made while the
caller still waits (GIL released) for the job to begin, but the last: a job counts as begun once
its `first` part (the matchers' accept) has run, so the thread goes from that call into its last
(the fill) without contending for the GIL.

A job runs exactly once, on its thread or on the caller: whoever takes its `claim` lock first.
`Job.join` and `Job.settle` run a job its thread has not begun (a busy host) on the calling
thread: a job may carry state changes (the matchers' accept) that must not be lost."""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from queue import SimpleQueue


class Begun:
    """The jobs of one `submit`: `lock` is released once all `n` have begun (one wake-up of the
    waiting caller, not one a job)."""
    __slots__ = ("lock", "count", "n")

    def __init__(self, n: int):
        self.lock, self.count, self.n = threading.Lock(), itertools.count(1), n
        if n:
            self.lock.acquire()

    def one(self) -> None:
        if next(self.count) == self.n:      # (itertools.count: atomic under the GIL)
            self.lock.release()


class Job:
    __slots__ = ("first", "fn", "claim", "begun", "done", "error")

    def __init__(self, fn: Callable[[], None], first: Callable[[], None] | None = None, begun: Begun | None = None):
        """first: run before `fn`, before the job counts as begun (None: nothing); `begun` is
        told then."""
        self.first, self.fn, self.begun = first, fn, begun or Begun(1)
        self.claim, self.done = threading.Lock(), threading.Lock()
        self.done.acquire()             # released by the thread once the job has run
        self.error: BaseException | None = None

    def run(self) -> None:
        """On the job's thread: nothing if the caller took it back first."""
        if not self.claim.acquire(blocking=False):
            return
        try:
            try:
                if self.first is not None:
                    self.first()
            finally:
                self.begun.one()
            self.fn()
        except BaseException as e:      # re-raised by join
            self.error = e
        self.done.release()

    def _run_here(self) -> None:
        if self.first is not None:
            self.first()
        self.fn()

    def join(self) -> bool:
        """Wait for the job (re-raising its error), or run it here if its thread has not begun
        it. -> whether it ran here."""
        if self.claim.acquire(blocking=False):
            self._run_here()
            return True
        self.done.acquire()
        if self.error is not None:
            raise self.error
        return False

    def settle(self) -> None:
        """Run it here if its thread has not begun it, else wait for it; its error dropped (the
        error of a step that failed before its `join`). A `join` after it returns at once."""
        if self.claim.acquire(blocking=False):
            try:
                self._run_here()
            except BaseException:
                pass
            self.done.release()
            return
        self.done.acquire()
        self.done.release()
        self.error = None


class FillThreads:
    """`n` daemon threads, started on the first `submit`, one job queue each."""

    def __init__(self, n: int, name: str):
        self.n, self.name = n, name
        self._queues: list[SimpleQueue] = []
        self._threads: list[threading.Thread] = []

    def submit(self, fns: list[Callable[[], None]], wait_s: float | None,
               firsts: list[Callable[[], None] | None] | None = None) -> list[Job]:
        """Job i (fns[i], after firsts[i] if given) on thread i (at most n). Waits up to `wait_s`
        in all (None: without limit) for the threads to begin them, their `first` part run:
        each needs the GIL to start, which this wait lets go of."""
        assert len(fns) <= self.n, (len(fns), self.n)
        if not self._threads:
            self._start()
        begun = Begun(len(fns))
        jobs = [Job(fn, first, begun) for fn, first in zip(fns, firsts or [None] * len(fns))]
        for q, job in zip(self._queues, jobs):
            q.put(job)
        if wait_s is None:
            begun.lock.acquire()
        elif wait_s > 0:
            begun.lock.acquire(timeout=wait_s)
        return jobs

    def _start(self) -> None:
        self._queues = [SimpleQueue() for _ in range(self.n)]
        self._threads = [threading.Thread(target=_serve, args=(q,), name=f"{self.name}-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._queues, self._threads = [], []


def _serve(jobs: SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()
