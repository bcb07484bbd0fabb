"""The engine core seen from an API process that did not start it (`--api-server-count` > 1,
serve/http/api_workers.py): the same face as the `multiprocessing.Process` the first API
process holds (`pid`, `sentinel`, `is_alive()`, `exitcode`), built on a Linux pidfd, which
becomes readable when the process exits whoever its parent is."""
from __future__ import annotations

import os
import select


class EngineProcess:
    """A running process this one did not start (`pid`); `sentinel` is readable once it exited."""

    def __init__(self, pid: int):
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)      # (ProcessLookupError when it is gone already)
        self.exitcode: int | None = None         # not ours to reap: unknown

    def is_alive(self) -> bool:
        if self.sentinel < 0:
            return False
        return not select.select([self.sentinel], [], [], 0)[0]

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1
