"""Graceful shutdown of the API process: SIGTERM and SIGINT alike.

uvicorn's own signal handling re-raises the caught signal once it has stopped; for SIGTERM
that kills the process before `APIServer.close` can stop the engine core and remove the
IPC folder. `GracefulServer` handles both signals without re-raising (a second Ctrl-C
still forces the exit), and on shutdown:

  1. stops accepting connections (uvicorn), running requests go on;
  2. after `drain_s`, calls `on_drain_timeout` (the engine client's `fail_all`): whole
     requests still running get a 503 error body, streams an error event and `[DONE]`;
  3. `FINISH_S` later uvicorn cancels whatever is left; then the server returns and the
     caller closes the engine core.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable

import uvicorn

FINISH_S = 5.0      # time to write the 503s and error events after the drain timeout
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_s: float, on_drain_timeout: Callable[[], None],
                 on_stop: Callable[[], None] | None = None):
        """on_stop: called as the shutdown starts (API process 0: stop the other API processes)."""
        config.timeout_graceful_shutdown = drain_s + FINISH_S
        super().__init__(config)
        self.drain_s, self.on_drain_timeout, self.on_stop = drain_s, on_drain_timeout, on_stop

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield      # signals reach the main thread only (a server run in a thread: tests)
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        if self.on_stop is not None:
            self.on_stop()
        timer = asyncio.get_running_loop().call_later(self.drain_s, self.on_drain_timeout)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
