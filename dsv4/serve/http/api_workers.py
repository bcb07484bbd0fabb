"""API processes 1..N-1 of `dsv4 serve --api-server-count N` (docs/architecture.md, "Serving").

API process 0 (the one `dsv4 serve` runs in) binds one listening socket per API process on
the port (SO_REUSEPORT, see below), spawns the engine core and then these, each with its
socket, its index and its own pair of pipes to the engine core (`Addresses.of(index)`). Each one waits
for the engine core's Ready (sent to every API process), sends itself the warm-up requests
and says "ready" on its pipe to process 0; process 0 says the server is ready once all did.

SO_REUSEPORT, not one listening socket shared: with one accept queue, the process that wakes
first takes every connection waiting (uvicorn accepts until the queue is empty), and clients
that keep connections alive (`dsv4 bench serve`, proxies) open theirs in a burst: 128
connections at once went 122 / 6 to two processes. The kernel hashes each connection to one
of the SO_REUSEPORT sockets instead, evenly whatever the timing. All N are still bound by
process 0 before any model loads (a busy port fails at once; port 0: the port the first one
got), and process 0 closes its copies of the others' once they started. (The price: another
program of the same user could join the port with SO_REUSEPORT; a process that dies resets
the connections still queued on its socket, and the server stops anyway.)

Lifecycle (`ApiWorkers`, run by process 0): SIGTERM/SIGINT of process 0 is passed on as
SIGTERM (each process drains its own requests, `shutdown.py`), and process 0 stops the
engine core after all of them ended. An API process that dies (exit code other than 0)
makes process 0 kill the engine core, so every other API process fails its requests in
flight (5xx, as when the engine core dies) and exits 1; one that stops with 0 (a signal
sent to it alone) stops the whole server gracefully. An API process other than 0 sees the
engine core's exit through a pidfd (serve/engine_process.py).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
from collections.abc import Callable


class ApiWorkers:
    """API processes 1..count-1, started with the engine core `engine_pid`'s pid."""

    def __init__(self, settings, socks: list[socket.socket], addresses, engine_pid: int, target: Callable):
        """socks: the listening sockets of processes 1..count-1, in order; target: the process
        entry, target(settings, index, sock, addresses, engine_pid, ready pipe) (server.run_api_worker)."""
        ctx = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self.pipes: list[multiprocessing.connection.Connection] = []     # each one's "ready" (or why not)
        self.stopped = False
        for index, sock in enumerate(socks, start=1):
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=target, name=f"dsv4-api-server-{index}",
                                  args=(settings, index, sock, addresses, engine_pid, writer))
            process.start()
            writer.close()
            self.processes.append(process)
            self.pipes.append(reader)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def wait_ready(self) -> str | None:
        """Block until every one said ready (None) or one failed or exited first (why)."""
        waiting = dict(enumerate(self.pipes, start=1))
        while waiting:
            sentinels = {self.processes[i - 1].sentinel: i for i in waiting}
            for ready in multiprocessing.connection.wait([*waiting.values(), *sentinels]):
                index = sentinels.get(ready) or next(i for i, pipe in waiting.items() if pipe is ready)
                pipe = waiting.pop(index, None)
                if pipe is None:
                    continue
                try:
                    kind, detail = pipe.recv()
                except EOFError:        # it exited without a word
                    process = self.processes[index - 1]
                    process.join(5)
                    return f"API process {index} exited with code {process.exitcode} while starting"
                if kind != "ready":
                    return f"API process {index}: {detail}"
        return None

    def watch(self, loop, on_exit: Callable[[int, int | None], None]) -> None:
        """on_exit(index, exit code) in `loop` when one of them ends."""
        for index, process in enumerate(self.processes, start=1):
            loop.add_reader(process.sentinel, self._exited, loop, index, on_exit)

    def _exited(self, loop, index: int, on_exit) -> None:
        process = self.processes[index - 1]
        loop.remove_reader(process.sentinel)
        process.join(1)
        on_exit(index, process.exitcode)

    def stop(self) -> None:
        """SIGTERM (once) to those still running: each drains its requests and exits."""
        if self.stopped:
            return
        self.stopped = True
        for process in self.processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` s for all to exit; kill the rest."""
        for process in self.processes:
            process.join(timeout)
            timeout = 0.1
            if process.is_alive():
                process.kill()
                process.join(5)
        for pipe in self.pipes:
            pipe.close()
