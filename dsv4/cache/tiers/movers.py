"""How the tiers copy between the cache and host rows (docs/architecture.md, "Host and disk tiers").

A mover starts a copy and returns a `Ticket`; the tiers poll it. Two stages per store:
`packed` (the source pages have been read: the GPU may reuse them) and `done` (the host rows
are written). Everything runs on the `Streams`' side stream (streams.py), ordered after the work
the main stream has queued so far: a store gathers its pages into the device staging buffer
(allocated once) in a fixed number of kernels (codec.py), records `packed` after the last
gather, and copies the staging rows to the pinned host rows in pieces of at most COPY_BYTES
(so a small copy of the main stream, e.g. a step's sampled tokens, never queues behind a whole
prefix); a load copies host rows into the staging buffer the same way and scatters them into
the pages. A copy larger than the buffer runs in rounds. What the step's thread does per copy
is a handful of launches per round, and it never waits: `Ticket.finish` (once `done`) makes
the main stream, not the host, wait for a load before anything reads its pages. With
`InlineStreams` (a CPU cache) both stages are done on return.
"""
from __future__ import annotations

import torch

from .codec import PageCodec
from .streams import InlineStreams, make_streams

COPY_BYTES = 8 << 20       # largest single host <-> device copy: about 0.15 ms of PCIe on an H200
STAGING_BYTES = 64 << 20   # the device staging buffer (one page row at least)


class Ticket:
    def __init__(self, streams: InlineStreams, packed=None, done=None, keep=(), to_main: bool = False):
        self.streams, self._packed, self._done, self.keep = streams, packed, done, keep   # events (None: done)
        self.to_main = to_main                                       # the main stream reads what it wrote
        self.tail: torch.Tensor | None = None                        # a load's checkpoint tail, on the device

    def packed(self) -> bool:
        return self._packed is None or self._packed.query()

    def done(self) -> bool:
        return self._done is None or self._done.query()

    def wait(self) -> None:
        """Block the host until done (drain only: tests, benchmarks, shutdown)."""
        if self._done is not None:
            self._done.synchronize()

    def finish(self) -> None:
        """Order the main stream after a load (call once `done`: costs the host nothing)."""
        if self.to_main:
            self.streams.main_waits(self._done)
            if self.tail is not None:        # made on the side stream, read on the main one
                self.streams.to_main(self.tail)
        self.keep = ()


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

    def __init__(self, streams: InlineStreams, codec: PageCodec):
        self.streams, self.codec, self.device = streams, codec, streams.device
        rows = max(1, STAGING_BYTES // (codec.numel * torch.empty((), dtype=codec.dtype).element_size()))
        self.staging = torch.empty(rows, codec.numel, dtype=codec.dtype, device=self.device)

    def _rounds(self, n: int):
        """(first, count) of each round of `n` pages."""
        step = self.staging.shape[0]
        return [(i, min(step, n - i)) for i in range(0, n, step)]

    def store(self, pages: list[int], rows: torch.Tensor, slots: list[int],
              tail: torch.Tensor | None, tail_row: torch.Tensor | None) -> Ticket:
        """Pack history pages `pages` into host rows `rows[slots]`, and `tail` into `tail_row`."""
        s, staging = self.streams, self.staging
        tail_copy = tail.clone() if tail is not None else None    # on the main stream: its slot may be reused
        s.after_main()
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
            done = s.record()
        return Ticket(s, packed, done, keep=(index, tail_copy))

    def load(self, rows: torch.Tensor, slots: list[int], pages: list[int], tail_row: torch.Tensor) -> Ticket:
        """Unpack host rows `rows[slots]` into history pages `pages`; the tail to the device."""
        s, staging = self.streams, self.staging
        s.after_main()                       # the pages may still be read by queued steps of their last owner
        with s.side():
            index = s.upload(pages)
            for first, n in self._rounds(len(pages)):
                for i, slot, k in runs(slots[first:first + n], piece_rows(rows)):
                    staging[i:i + k].copy_(rows[slot:slot + k], non_blocking=True)
                self.codec.scatter(staging[:n], index[first:first + n])
            tail = tail_row.to(self.device, copy=True, non_blocking=True)
            done = s.record()
        t = Ticket(s, None, done, keep=(index,), to_main=True)
        t.tail = tail
        return t


def piece_rows(rows: torch.Tensor) -> int:
    """Rows of `rows` in one host <-> device copy of at most COPY_BYTES."""
    return max(1, COPY_BYTES // max(1, rows.shape[1] * rows.element_size()))


def make_mover(codec: PageCodec) -> Mover:
    return Mover(make_streams(codec.storage.kinds["c4"].device), codec)
