"""What the tiers count (docs/architecture.md, "Host and disk tiers"): tokens resumed from each
tier, bytes moved each way, copy latencies, errors. Plain numbers; the engine reports them."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))   # last: +Inf
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Observations <= each bucket bound, then the count (Prometheus' `le` buckets)."""
        out, n = [], 0
        for c in self.counts:
            n += c
            out.append(n)
        return out


@dataclass
class TierStats:
    hit_tokens: dict = field(default_factory=lambda: {"host": 0, "disk": 0})   # resumed tokens a tier supplied
    bytes: dict = field(default_factory=lambda: {"gpu_to_host": 0, "host_to_gpu": 0, "host_to_disk": 0,
                                                 "disk_to_host": 0})
    latency: dict = field(default_factory=lambda: {"host_store": Histogram(), "host_load": Histogram(),
                                                   "disk_store": Histogram(), "disk_load": Histogram()})
    disk_write_errors: int = 0
    disk_bad_files: int = 0       # refused: truncated, corrupted, other signature, left by a killed write
    host_full: int = 0            # offloads skipped: every host row referenced

    def as_dict(self) -> dict:
        return {"hit_tokens": dict(self.hit_tokens), "bytes": dict(self.bytes),
                "latency": {k: {"buckets": list(BUCKETS), "counts": list(h.counts), "sum": h.total}
                            for k, h in self.latency.items()},
                "disk_write_errors": self.disk_write_errors, "disk_bad_files": self.disk_bad_files,
                "host_full": self.host_full}
