"""The router's engines: per role, the HTTP URL, requests in flight, and whether it answers.

Choice: least in-flight requests first, round-robin among equals (`policy="round-robin"`:
plain rotation). An engine that refused a connection is skipped for `DOWN_S` seconds."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

DOWN_S = 5.0


@dataclass
class Backend:
    url: str
    role: str
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    down_until: float = 0.0
    state_address: str | None = None      # prefill: its state server (GET /disagg/info)

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self) -> None:
        self.failures += 1
        self.down_until = time.monotonic() + DOWN_S


class Pool:
    def __init__(self, role: str, urls: list[str], policy: str = "least-loaded"):
        if not urls:
            raise ValueError(f"--{role}: at least one URL")
        self.role, self.policy = role, policy
        self.backends = [Backend(u.rstrip("/"), role) for u in urls]
        self._turn = itertools.count()

    def pick(self, exclude: set[str] = frozenset()) -> Backend | None:
        """The next engine to use, or None when every one is excluded or down."""
        n = len(self.backends)
        start = next(self._turn) % n
        order = [self.backends[(start + i) % n] for i in range(n)]
        candidates = [b for b in order if b.url not in exclude and b.up] or \
                     [b for b in order if b.url not in exclude]        # all down: try anyway
        if not candidates:
            return None
        if self.policy == "round-robin":
            return candidates[0]
        return min(candidates, key=lambda b: b.in_flight)     # stable: ties keep rotation order
