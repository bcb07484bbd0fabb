"""Where the tiers' copies run and how their completion is seen (docs/architecture.md, "Host and
disk tiers").

A `Streams` gives the mover (movers.py) these: mark the work the main stream has queued so far
(`mark_main`, on the step's thread when a copy is asked for) and order the side stream after
that mark (`side_waits`, on the mover's thread), run copies on it (`side`), mark a point of it
(`record`: an event with `query()` and `synchronize()`, or None for "already done") and make
the main stream wait for a point before it reads what a copy wrote (`main_waits`).

`CudaStreams`: one side stream; nothing here blocks the host — `record` and `main_waits` are
stream operations, and only `drain` (tests, benchmarks, shutdown) ever calls `synchronize`.
`InlineStreams`: the CPU cache, where every copy is done when it is issued. Tests subclass it
with events that complete later (tests/engine/test_kv_tier_accounting.py), so the bookkeeping
of copies in flight runs on CPU as it does beside a side stream.
"""
from __future__ import annotations

import contextlib

import torch


class InlineStreams:
    """Copies run at once on the caller's thread (a CPU cache)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def mark_main(self):
        """The main stream's work queued so far (an event, or None: all done)."""
        return None

    def side_waits(self, mark) -> None:
        """Order the side stream after `mark` (from `mark_main`)."""

    def side(self):
        return contextlib.nullcontext()

    def record(self):
        return None

    def main_waits(self, event) -> None:
        pass

    def to_main(self, tensor: torch.Tensor) -> None:
        """`tensor`, made on the side stream, is used on the main one from now on."""

    def upload(self, values: list[int]) -> torch.Tensor:
        """`values` as a long tensor on the device (call inside `side()`)."""
        return torch.tensor(values, dtype=torch.long, device=self.device)


class CudaStreams(InlineStreams):
    """One side stream of `device`; copies from pinned host memory, never a host wait."""

    def __init__(self, device):
        super().__init__(device)
        self.stream = torch.cuda.Stream(self.device)

    def _main(self):
        return torch.cuda.current_stream(self.device)

    def mark_main(self):
        return self._main().record_event()

    def side_waits(self, mark) -> None:
        if mark is not None:
            self.stream.wait_event(mark)

    def side(self):
        return torch.cuda.stream(self.stream)

    def record(self):
        return self.stream.record_event()

    def main_waits(self, event) -> None:
        if event is not None:
            self._main().wait_event(event)

    def to_main(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self._main())

    def upload(self, values: list[int]) -> torch.Tensor:
        # pinned, so the copy is queued on the side stream without a host wait (the caching host
        # allocator keeps the pinned block until the copy has run)
        host = torch.tensor(values, dtype=torch.long).pin_memory()
        return host.to(self.device, non_blocking=True)


def make_streams(device) -> InlineStreams:
    return CudaStreams(device) if torch.device(device).type == "cuda" else InlineStreams(device)
