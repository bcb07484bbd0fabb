"""Where a process's CPU time goes, by Python function, from stack samples (benchmarks/serve_path.py).

Every `interval` seconds of the process's CPU time (ITIMER_PROF: busy time, not waiting)
the main thread's stack is sampled: the innermost Python function gets a "self" sample (a C
function it is inside, e.g. a socket write, counts as its own) and every function on the
stack a "total" sample. Unlike cProfile it costs nearly nothing per call and measures CPU,
not wall time, so shared cores do not skew it. Linux/Unix only; main thread only.
"""
from __future__ import annotations

import os
import signal
from collections import Counter


class Sampler:
    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.own: Counter = Counter()
        self.total: Counter = Counter()
        self.samples = 0

    def start(self) -> "Sampler":
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self.interval, self.interval)
        return self

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, signal.SIG_DFL)

    def _sample(self, signum, frame) -> None:
        self.samples += 1
        if frame is None:
            return
        self.own[_name(frame.f_code)] += 1
        seen = set()
        while frame is not None:
            seen.add(_name(frame.f_code))
            frame = frame.f_back
        self.total.update(seen)

    def report(self, top: int = 20, per: float = 0.0, unit: str = "", by: str = "own") -> str:
        """The `top` functions by own samples (`by="total"`: by total samples), with their totals;
        as a share of all samples and, when `per` (seconds of CPU per unit, e.g. per output
        token) is given, in µs per unit."""
        n = max(self.samples, 1)
        scale = (per * 1e6 / n) if per else 0.0
        head = f"{self.samples} samples of {self.interval * 1e3:g} ms CPU" + (f"; µs per {unit}" if per else "")
        lines = [head, f"{'own %':>6} {'total %':>7}" + (f" {'own µs':>7} {'tot µs':>7}" if per else "") + "  function"]
        for name, _ in (self.own if by == "own" else self.total).most_common(top):
            count = self.own[name]
            row = f"{100 * count / n:6.1f} {100 * self.total[name] / n:7.1f}"
            if per:
                row += f" {count * scale:7.2f} {self.total[name] * scale:7.2f}"
            lines.append(f"{row}  {name}")
        return "\n".join(lines)

    def state(self) -> dict:
        return {"interval": self.interval, "samples": self.samples, "own": dict(self.own), "total": dict(self.total)}

    @classmethod
    def from_state(cls, state: dict) -> "Sampler":
        s = cls(state["interval"])
        s.samples, s.own, s.total = state["samples"], Counter(state["own"]), Counter(state["total"])
        return s


def _name(code) -> str:
    path = code.co_filename
    parts = path.split(os.sep)
    short = os.sep.join(parts[-2:]) if "site-packages" not in path else os.sep.join(parts[parts.index("site-packages") + 1:])
    return f"{short}:{code.co_firstlineno}({code.co_name})"
