"""benchmarks/host_sections.py: each wrapped call's own time goes to its component (the time of
wrapped calls inside it goes to theirs), so the parts add up to the top-level calls' time; the
wrappers come off again."""
from __future__ import annotations

import pytest

from benchmarks.host_sections import Sections, breakdown


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Work:
    def __init__(self, clock: Clock):
        self.clock = clock

    def outer(self) -> str:
        self.clock.now += 1.0
        self.inner()
        self.clock.now += 2.0
        self.inner()
        return "done"

    def inner(self) -> None:
        self.clock.now += 0.5


def test_own_time_per_component_and_restore():
    clock = Clock()
    work, sections = Work(clock), Sections(clock)
    sections.wrap(work, "outer", "outer part")
    sections.wrap(work, "inner", "inner part")
    assert work.outer() == "done"
    assert sections.seconds == {"outer part": 3.0, "inner part": 1.0}
    sections.restore()
    assert "outer" not in vars(work) and "inner" not in vars(work)
    work.outer()
    assert sum(sections.seconds.values()) == 4.0                  # no timer left behind


def test_breakdown_per_request_and_step_splits_processes_and_leaves_device_parts_out():
    seconds = {"scheduler": 0.002, "api: detokenise + SSE chunk": 0.001, "sampler kernels (device)": 0.004}
    rows, host = breakdown(seconds, steps=2, concurrency=10)
    assert rows[0] == ("sampler kernels (device)", pytest.approx(200.0))
    assert host == pytest.approx({"all": 150.0, "engine_core": 100.0, "api": 50.0})
