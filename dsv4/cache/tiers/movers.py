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


def runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots: one copy each."""
    out = []
    for i, slot in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == slot:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, slot, 1))
    return out


class SyncMover:
    """Copies at once (a CPU cache)."""

    def store(self, codec: PageCodec, pages: list[int], rows: torch.Tensor, slots: list[int],
              tail: torch.Tensor | None, tail_row: torch.Tensor | None) -> Ticket:
        """Pack history pages `pages` into host rows `rows[slots]`, and `tail` into `tail_row`."""
        for p, slot in zip(pages, slots):
            codec.pack(p, rows[slot])
        if tail is not None:
            tail_row.copy_(tail)
        return Ticket()

    def load(self, codec: PageCodec, rows: torch.Tensor, slots: list[int], pages: list[int],
             tail_row: torch.Tensor) -> Ticket:
        """Unpack host rows `rows[slots]` into history pages `pages`; the tail to the device."""
        device = codec.storage.kinds["c4"].device
        for slot, p in zip(slots, pages):
            codec.unpack(rows[slot].to(device), p)
        t = Ticket()
        t.tail = tail_row.to(device, copy=True)
        return t


class CudaMover:
    """Copies on a side stream: one device-to-host (or back) copy per run of consecutive slots."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def _after_main(self) -> None:
        self.stream.wait_event(torch.cuda.current_stream(self.device).record_event())

    def store(self, codec, pages, rows, slots, tail, tail_row) -> Ticket:
        tail_copy = tail.clone() if tail is not None else None     # on the main stream: its slot may be reused
        self._after_main()
        with torch.cuda.stream(self.stream):
            staging = torch.empty(len(pages), codec.numel, dtype=codec.dtype, device=self.device)
            for i, p in enumerate(pages):
                codec.pack(p, staging[i])
            packed = self.stream.record_event()
            for i, slot, n in runs(slots):
                rows[slot:slot + n].copy_(staging[i:i + n], non_blocking=True)
            if tail_copy is not None:
                tail_row.copy_(tail_copy, non_blocking=True)
            done = self.stream.record_event()
        return Ticket(packed, done, keep=(staging, tail_copy))

    def load(self, codec, rows, slots, pages, tail_row) -> Ticket:
        self._after_main()                   # the pages may still be read by queued steps of their last owner
        with torch.cuda.stream(self.stream):
            staging = torch.empty(len(pages), codec.numel, dtype=codec.dtype, device=self.device)
            for i, slot, n in runs(slots):
                staging[i:i + n].copy_(rows[slot:slot + n], non_blocking=True)
            for i, p in enumerate(pages):
                codec.unpack(staging[i], p)
            tail = tail_row.to(self.device, non_blocking=True)
            done = self.stream.record_event()
        t = Ticket(None, done, keep=(staging,))
        t.tail = tail
        return t


def make_mover(device) -> SyncMover | CudaMover:
    return CudaMover(device) if torch.device(device).type == "cuda" else SyncMover()
