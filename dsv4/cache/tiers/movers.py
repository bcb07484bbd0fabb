"""How the tiers copy between the cache and host rows (docs/architecture.md, "Host and disk tiers").

A mover starts a copy and returns a `Ticket`; the tiers poll it. Two stages per store:
`packed` (the source pages have been read: the GPU may reuse them) and `done` (the host rows
are written). Everything runs on the `Streams`' side stream (streams.py), ordered after the work
the main stream has queued so far: a store gathers its pages into the device staging buffer
(allocated once) in a fixed number of kernels (codec.py), records `packed` after the last
gather, and copies the staging rows to the pinned host rows in pieces of at most COPY_BYTES
(so a small copy of the main stream, e.g. a step's sampled tokens, never queues behind a whole
prefix); a load copies host rows into the staging buffer the same way and scatters them into
the pages. A copy larger than the buffer runs in rounds.

Threads: the step's thread only asks for a copy (O(1): a mark of the main stream, a clone of a
store's tail, a job queued) and never waits; the mover's own thread (`make_mover(background=
True)`, when serving) issues every launch of it, in the order asked, so the upload of its page
list, the gathers, the host copies and their events cost the step's thread nothing.
`Ticket.finish` (once `done`) makes the main stream, not the host, wait for a load before
anything reads its pages. With the synchronous executor (CPU tests) the copy is issued at
once; with `InlineStreams` (a CPU cache) both stages are done once issued.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .codec import PageCodec
from .executors import SyncExecutor, make_executor
from .streams import InlineStreams, make_streams

COPY_BYTES = 8 << 20       # largest single host <-> device copy: about 0.15 ms of PCIe on an H200
STAGING_BYTES = 64 << 20   # the device staging buffer (one page row at least)


@dataclass(eq=False)
class Issued:
    """What the mover's thread issued for one copy: its events (None: done) and what the side
    stream reads or writes meanwhile (kept alive until the copy is done)."""
    packed: object = None
    done: object = None
    keep: tuple = ()
    tail: torch.Tensor | None = None         # a load's checkpoint tail, on the device


class Ticket:
    """A copy asked of the mover: `future` gives its `Issued` once the mover's thread has issued
    it (at once with the synchronous executor)."""

    def __init__(self, streams: InlineStreams, future: Future, to_main: bool = False):
        self.streams, self.future = streams, future
        self.to_main = to_main                                       # the main stream reads what it wrote

    def _issued(self) -> Issued | None:
        return self.future.result() if self.future.done() else None

    def packed(self) -> bool:
        got = self._issued()
        return got is not None and (got.packed is None or got.packed.query())

    def done(self) -> bool:
        got = self._issued()
        return got is not None and (got.done is None or got.done.query())

    @property
    def tail(self) -> torch.Tensor | None:
        return self.future.result().tail

    def wait(self) -> None:
        """Block the host until done (drain only: tests, benchmarks, shutdown)."""
        got = self.future.result()
        if got.done is not None:
            got.done.synchronize()

    def finish(self) -> None:
        """Order the main stream after a load (call once `done`: costs the host nothing)."""
        got = self.future.result()
        if self.to_main:
            self.streams.main_waits(got.done)
            if got.tail is not None:        # made on the side stream, read on the main one
                self.streams.to_main(got.tail)
        got.keep = ()


def runs(slots: list[int], limit: int | None = None) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots, at most `limit` long:
    one copy each."""
    out = []
    for i, slot in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == slot and (limit is None or out[-1][2] < limit):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, slot, 1))
    return out


class Mover:
    """Copies of `codec`'s pages through one device staging buffer of at most STAGING_BYTES,
    allocated once: a copy larger than it runs in rounds, which the side stream orders (a round
    reuses the buffer only after the previous round's host copies), so no copy allocates
    device memory or waits on the host."""

    def __init__(self, streams: InlineStreams, codec: PageCodec, executor=None):
        self.streams, self.codec, self.device = streams, codec, streams.device
        self.executor = executor if executor is not None else SyncExecutor()   # the mover's thread
        rows = max(1, STAGING_BYTES // (codec.numel * torch.empty((), dtype=codec.dtype).element_size()))
        self.staging = torch.empty(rows, codec.numel, dtype=codec.dtype, device=self.device)

    def _rounds(self, n: int):
        """(first, count) of each round of `n` pages."""
        step = self.staging.shape[0]
        return [(i, min(step, n - i)) for i in range(0, n, step)]

    def store(self, pages: list[int], rows: torch.Tensor, slots: list[int],
              tail: torch.Tensor | None, tail_row: torch.Tensor | None) -> Ticket:
        """Pack history pages `pages` into host rows `rows[slots]`, and `tail` into `tail_row`.
        On the caller's thread: a clone of the tail (its slot may be reused) and a mark of the
        main stream; the rest is issued by the mover's thread."""
        tail_copy = tail.clone() if tail is not None else None
        mark = self.streams.mark_main()
        return Ticket(self.streams, self.executor.submit(self._store, mark, pages, rows, slots, tail_copy,
                                                         tail_row))

    def _store(self, mark, pages, rows, slots, tail_copy, tail_row) -> Issued:
        s, staging = self.streams, self.staging
        s.side_waits(mark)
        with s.side():
            index = s.upload(pages)
            if tail_copy is not None:
                tail_row.copy_(tail_copy, non_blocking=True)
            packed = None
            for first, n in self._rounds(len(pages)):
                self.codec.gather(index[first:first + n], staging[:n])
                if first + n == len(pages):
                    packed = s.record()
                for i, slot, k in runs(slots[first:first + n], piece_rows(rows)):
                    rows[slot:slot + k].copy_(staging[i:i + k], non_blocking=True)
            return Issued(packed, s.record(), keep=(index, tail_copy))

    def load(self, rows: torch.Tensor, slots: list[int], pages: list[int], tail_row: torch.Tensor) -> Ticket:
        """Unpack host rows `rows[slots]` into history pages `pages`; the tail to the device. On
        the caller's thread: a mark of the main stream (the pages may still be read by queued
        steps of their last owner); the copies are issued by the mover's thread."""
        mark = self.streams.mark_main()
        return Ticket(self.streams, self.executor.submit(self._load, mark, rows, slots, pages, tail_row),
                      to_main=True)

    def _load(self, mark, rows, slots, pages, tail_row) -> Issued:
        s, staging = self.streams, self.staging
        s.side_waits(mark)
        with s.side():
            index = s.upload(pages)
            for first, n in self._rounds(len(pages)):
                for i, slot, k in runs(slots[first:first + n], piece_rows(rows)):
                    staging[i:i + k].copy_(rows[slot:slot + k], non_blocking=True)
                self.codec.scatter(staging[:n], index[first:first + n])
            tail = tail_row.to(self.device, copy=True, non_blocking=True)
            return Issued(None, s.record(), keep=(index,), tail=tail)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def piece_rows(rows: torch.Tensor) -> int:
    """Rows of `rows` in one host <-> device copy of at most COPY_BYTES."""
    return max(1, COPY_BYTES // max(1, rows.shape[1] * rows.element_size()))


def make_mover(codec: PageCodec, background: bool) -> Mover:
    """A mover on the cache's device; `background`: its copies are issued by a thread of its own."""
    return Mover(make_streams(codec.storage.kinds["c4"].device), codec, make_executor(background, "dsv4-kv-mover"))
