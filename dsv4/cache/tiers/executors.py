"""Where the disk tier's file work and the mover's copies run: `SyncExecutor` (at once, on the caller's thread: CPU
tests, deterministic) or a one-thread pool (serving: the step loop never waits on a file)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class SyncExecutor:
    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:           # the caller collects it like a thread's
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


def make_executor(background: bool, name: str = "dsv4-disk-kv"):
    """One thread named `name` (jobs run in the order submitted), or at once when not `background`."""
    return ThreadPoolExecutor(1, thread_name_prefix=name) if background else SyncExecutor()
