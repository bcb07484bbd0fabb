"""Grammar compiles off the engine's step path (docs/architecture.md, "Structured outputs"):
one daemon thread compiles the constraints handed to it, in order, through the registry's
`GrammarCache` (xgrammar releases the GIL while it builds and compiles, so the step loop goes
on meanwhile). A finished compile is queued for the owner to take on its own thread (`take`),
then `notify` is called on this thread (the grammar worker tells the engine there)."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from ..sampling_params import StructuredOutputs
from .grammars import GrammarError


class CompileThread:
    def __init__(self, compile: Callable[[StructuredOutputs], object],
                 notify: Callable[[object, str | None], None] | None = None):
        """compile: spec -> compiled grammar, raising GrammarError for a bad one (called on the
        thread); notify(handle, error or None): after each result is queued, on the thread."""
        self._compile, self._notify = compile, notify
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()       # (handle, spec) | None: stop
        self._done: queue.SimpleQueue = queue.SimpleQueue()       # (handle, compiled | None, error | None)
        self._finished = threading.Semaphore(0)                    # one release per result queued
        self._thread = threading.Thread(target=self._run, name="dsv4-grammar-compile", daemon=True)
        self._thread.start()

    def submit(self, handle, spec: StructuredOutputs) -> None:
        self._jobs.put((handle, spec))

    def take(self) -> list[tuple[object, object | None, GrammarError | None]]:
        """The compiles finished since the last call (never waits): (handle, compiled, None)
        or (handle, None, the GrammarError)."""
        done = []
        while self._finished.acquire(blocking=False):
            done.append(self._done.get())
        return done

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a finished compile (left for `take`); whether one is."""
        if self._finished.acquire(timeout=timeout):
            self._finished.release()
            return True
        return False

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            handle, spec = job
            try:
                result = (handle, self._compile(spec), None)
            except GrammarError as e:
                result = (handle, None, e)
            except Exception as e:  # noqa: BLE001 - any failure fails this constraint's request alone
                result = (handle, None, GrammarError(f"{type(e).__name__}: {e}"))
            self._done.put(result)
            self._finished.release()
            if self._notify is not None:
                self._notify(handle, None if result[2] is None else str(result[2]))
