"""How the tiers copy between the cache and host rows (docs/architecture.md, "Host and disk tiers").

A mover starts a copy and returns a `Ticket`; the tiers poll it. Two stages per store:
`packed` (the source pages have been read: the GPU may reuse them) and `done` (the host rows
are written). `SyncMover` copies at once (CPU cache: both stages are done on return);
`CudaMover` runs on a side stream ordered after the work the main stream has queued so far:
a store packs the pages into a device staging buffer, records `packed`, then copies the
staging buffer to the pinned host rows; a load copies host rows to a staging buffer and unpacks
it into the pages. The step never waits on either; `Ticket.finish` makes the main stream wait
for a finished load before anything reads its pages.
"""
from __future__ import annotations

import torch

from .codec import PageCodec


class Ticket:
    def __init__(self, packed=None, done=None, keep=()):
        self._packed, self._done, self.keep = packed, done, keep     # events (None: already done)
        self.tail: torch.Tensor | None = None                         # a load's checkpoint tail, on the device

    def packed(self) -> bool:
        return self._packed is None or self._packed.query()

    def done(self) -> bool:
        return self._done is None or self._done.query()

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def finish(self) -> None:
        """Order the current stream after the copy (call once `done`)."""
        if isinstance(self._done, torch.cuda.Event):
            main = torch.cuda.current_stream()
            main.wait_event(self._done)
            if self.tail is not None:        # made on the side stream, read on the main one
                self.tail.record_stream(main)
        self.keep = ()


class SyncMover:
    def store(self, codec: PageCodec, pages: list[int], rows: list[torch.Tensor],
              tail: torch.Tensor | None, tail_row: torch.Tensor | None) -> Ticket:
        for p, row in zip(pages, rows):
            codec.pack(p, row)
        if tail is not None:
            tail_row.copy_(tail)
        return Ticket()

    def load(self, codec: PageCodec, rows: list[torch.Tensor], pages: list[int], tail_row: torch.Tensor
             ) -> Ticket:
        for row, p in zip(rows, pages):
            codec.unpack(row.to(codec.storage.kinds["c4"].device), p)
        t = Ticket()
        t.tail = tail_row.to(codec.storage.kinds["c4"].device, copy=True)
        return t


class CudaMover:
    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def _after_main(self) -> None:
        self.stream.wait_event(torch.cuda.current_stream(self.device).record_event())

    def store(self, codec, pages, rows, tail, tail_row) -> Ticket:
        tail_copy = tail.clone() if tail is not None else None     # on the main stream: its slot may be reused
        self._after_main()
        with torch.cuda.stream(self.stream):
            staging = torch.empty(len(pages), codec.numel, dtype=codec.dtype, device=self.device)
            for i, p in enumerate(pages):
                codec.pack(p, staging[i])
            packed = self.stream.record_event()
            for i, row in enumerate(rows):
                row.copy_(staging[i], non_blocking=True)
            if tail_copy is not None:
                tail_row.copy_(tail_copy, non_blocking=True)
            done = self.stream.record_event()
        return Ticket(packed, done, keep=(staging, tail_copy))

    def load(self, codec, rows, pages, tail_row) -> Ticket:
        self._after_main()                   # the pages may still be read by queued steps of their last owner
        with torch.cuda.stream(self.stream):
            staging = torch.empty(len(pages), codec.numel, dtype=codec.dtype, device=self.device)
            for i, row in enumerate(rows):
                staging[i].copy_(row, non_blocking=True)
            for i, p in enumerate(pages):
                codec.unpack(staging[i], p)
            tail = tail_row.to(self.device, non_blocking=True)
            done = self.stream.record_event()
        t = Ticket(None, done, keep=(staging,))
        t.tail = tail
        return t


def make_mover(device) -> SyncMover | CudaMover:
    return CudaMover(device) if torch.device(device).type == "cuda" else SyncMover()
