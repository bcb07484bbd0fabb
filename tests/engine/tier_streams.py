"""A side stream for the tiers' mover on CPU (dsv4/cache/tiers/streams.py): copies are done at
once, but their events complete, in order, only when the test advances the stream, as a real
stream's do some steps later; every host wait (`synchronize`) is counted."""
from __future__ import annotations

import random

from dsv4.cache.tiers.streams import InlineStreams


class Later:
    """An event of a `DeferredStreams`: complete when the stream gets there (or when waited for)."""

    def __init__(self, stream: "DeferredStreams"):
        self.stream, self.fired = stream, False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.stream.waits += 1
        self.stream.reach(self)


class DeferredStreams(InlineStreams):
    """A side stream whose copies are done at once but whose events complete, in order, only
    when `fire` advances it (as a real stream's do, some steps later); `waits` counts host waits."""

    def __init__(self, rng: random.Random):
        super().__init__("cpu")
        self.rng, self.pending, self.waits = rng, [], 0

    def record(self) -> Later:
        self.pending.append(Later(self))
        return self.pending[-1]

    def reach(self, event: Later) -> None:
        while event in self.pending:
            self.pending.pop(0).fired = True

    def fire(self) -> None:
        """Advance the stream by a random number of events (often none)."""
        for _ in range(min(len(self.pending), max(0, self.rng.randint(-2, 3)))):
            self.pending.pop(0).fired = True
