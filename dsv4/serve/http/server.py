"""Starting and stopping the processes of `dsv4 serve` (the API process, or N of them:
api_workers.py, and the engine core).

`APIServer` binds the listening socket first (a busy port fails before any model loads),
then spawns the engine core and waits until it is ready, then runs uvicorn on that socket
in the calling thread. When the engine core dies the server stops (exit code 1); on
SIGTERM, SIGINT or `stop()` it shuts down gracefully (`shutdown.py`) and exits 0; either way
it then stops the engine core (which also exits by itself if this process dies) and
removes the IPC folder.
"""
from __future__ import annotations

import asyncio
import gc
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn

from ...config import EngineConfig
from .api import build_app
from ..client import EngineClient, EngineStartError
from ...engine.core import run_engine_core
from ...engine.ipc import Ready
from .limits import ServerLimits
from .api_workers import ApiWorkers
from .connection import http_protocol
from .shutdown import FINISH_S, GracefulServer
from .state import ServerState


@dataclass
class ServeSettings:
    model_dir: str
    model_names: list[str]
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    limits: ServerLimits = field(default_factory=ServerLimits)
    disagg: object = None            # DisaggSettings (dsv4/disagg/settings.py) for --role prefill|decode
    api_server_count: int = 1        # API processes (api_workers.py); 1 for a disaggregated role


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """`reuse_port`: SO_REUSEPORT, for one socket per API process on the same port (api_workers.py)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on one port (port 0: the one the first got), SO_REUSEPORT
    when several; all closed when one cannot bind."""
    socks = [listen_socket(host, port, reuse_port=count > 1)]
    try:
        for _ in range(count - 1):
            socks.append(listen_socket(host, socks[0].getsockname()[1], reuse_port=True))
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class APIServer:
    """API process 0 (binds `sock`, spawns the engine core and, with `api_server_count` > 1, the
    other API processes: api_workers.py), or, given `sock` and an attached `client`, one of those."""

    def __init__(self, settings: ServeSettings, engine_target: Callable = run_engine_core,
                 sock: socket.socket | None = None, client: EngineClient | None = None):
        self.settings = settings
        socks = [sock] if sock is not None else listen_sockets(settings.host, settings.port, settings.api_server_count)
        self.sock, self.worker_socks = socks[0], socks[1:]     # (the other API processes' sockets, until they start)
        self.port = self.sock.getsockname()[1]
        if settings.disagg is not None:
            from ...disagg.serving import role_engine_target
            engine_target = role_engine_target(settings.disagg)
        self.client = client or EngineClient(settings.model_dir, settings.engine, engine_target,
                                             count=settings.api_server_count)
        self.workers: ApiWorkers | None = None       # API processes 1..N-1 (process 0 only)
        self.uvicorn: GracefulServer | None = None
        self.engine_died = False
        self.failed = False               # an API process failed or died (process 0)

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"http://{host}:{self.port}"

    def start_engine(self, timeout: float | None = None) -> Ready:
        """Spawn the engine core and wait for it; EngineStartError says why it could not start."""
        try:
            return self.client.start(timeout, spawned=self._start_workers)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, engine_pid: int) -> None:
        if self.worker_socks:
            self.workers = ApiWorkers(self.settings, self.worker_socks, self.client.addresses, engine_pid,
                                      run_api_worker)
            self._close_worker_socks()      # theirs now: a copy left open here would queue connections nobody takes

    def _close_worker_socks(self) -> None:
        for sock in self.worker_socks:
            sock.close()
        self.worker_socks = []

    @property
    def pids(self) -> dict[str, list[int]]:
        """{"api": API processes' pids (this one first), "engine": [the engine core's]} (process 0)."""
        workers = self.workers.pids if self.workers is not None else []
        return {"api": [os.getpid(), *workers], "engine": [self.client.process.pid]}

    def serve(self, on_ready: Callable[[], None] | None = None) -> int:
        """Run until stopped (SIGTERM, Ctrl-C, `stop()`) or the engine dies; 1 when it died."""
        s = self.settings
        try:
            state = ServerState.create(self.client, s.model_dir, s.model_names, s.api_key, s.limits,
                                       s.engine.tokenizer)
            self.client.on_death = self._engine_died
            app = build_app(state, self._when_all_ready(on_ready), warm=s.disagg is None,   # (a role's request needs its peer)
                            server_index=self.client.index if s.api_server_count > 1 else None)
            if s.disagg is not None:
                from ...disagg.serving import add_disagg_routes
                add_disagg_routes(app, state, s.disagg)
            config = uvicorn.Config(app, log_level=s.log_level,
                                    http=http_protocol(s.limits.header_timeout, s.limits.body_timeout))
            gc.freeze()     # start-up objects (app, tokenizer) out of the full collections that run while serving
            self.uvicorn = GracefulServer(config, s.limits.shutdown_timeout, self.client.fail_all,
                                          on_stop=self.workers.stop if self.workers is not None else None)
            self.uvicorn.run(sockets=[self.sock])
        except KeyboardInterrupt:
            pass   # a Ctrl-C before uvicorn took over the signals
        finally:
            self.close()
        return 1 if self.engine_died or self.failed else 0

    def _when_all_ready(self, on_ready: Callable[[], None] | None):
        """`on_ready`, once the other API processes are ready too (process 0 with workers);
        one that fails to start stops the server (exit 1)."""
        if self.workers is None:
            return on_ready

        async def all_ready() -> None:
            error = await asyncio.to_thread(self.workers.wait_ready)
            if error is not None:
                print(f"dsv4 serve: {error}; shutting down", file=sys.stderr, flush=True)
                self.failed = True
                self.stop()
                return
            self.workers.watch(asyncio.get_running_loop(), self._worker_exited)
            if on_ready is not None:
                on_ready()
        return all_ready

    def _worker_exited(self, index: int, exitcode: int | None) -> None:
        if self.uvicorn is None or self.uvicorn.should_exit:
            return        # (shutting down: they were told to)
        if exitcode == 0:       # stopped by a signal sent to it alone: stop the rest alike
            print(f"dsv4 serve: API process {index} stopped; shutting down", file=sys.stderr, flush=True)
            self.stop()
            return
        print(f"dsv4 serve: API process {index} died (exit code {exitcode}); failing the requests in flight "
              f"and shutting down", file=sys.stderr, flush=True)
        self.failed = True
        self.client.lose(f"API process {index} died; the server is shutting down")
        self.client.process.kill()      # every other API process then sees the engine core end (api_workers.py)

    def stop(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    def _engine_died(self, reason: str) -> None:
        self.engine_died = True
        if not self.failed:
            print(f"dsv4 serve: {reason.split(';')[0]}; shutting down", file=sys.stderr, flush=True)
        self.stop()

    def close(self) -> None:
        if self.workers is not None:        # they drain (SIGTERM), then the engine core stops
            if not self.engine_died:        # (else they fail their requests and exit by themselves)
                self.workers.stop()
            self.workers.join(self.settings.limits.shutdown_timeout + FINISH_S + 5)
        self.client.close()
        self.sock.close()
        self._close_worker_socks()


def run_api_worker(settings: ServeSettings, index: int, sock: socket.socket, addresses, engine_pid: int,
                   ready) -> None:
    """Process entry of API process `index` > 0 (api_workers.py): attach to the engine core
    `engine_pid`, serve on `sock`, say "ready" on the pipe `ready`; exit 0 when stopped, 1 when
    the engine core died or could not start (process 0 reports why)."""
    client = EngineClient(settings.model_dir, settings.engine, count=settings.api_server_count,
                          addresses=addresses, index=index)
    try:
        client.attach(engine_pid)
    except EngineStartError as e:
        ready.send(("failed", str(e)))
        sys.exit(1)
    except KeyboardInterrupt:            # Ctrl-C while the model loads: process 0 reports it
        client.close()
        sys.exit(130)
    server = APIServer(settings, sock=sock, client=client)
    code = server.serve(on_ready=lambda: ready.send(("ready", os.getpid())))
    ready.close()
    sys.exit(code)
