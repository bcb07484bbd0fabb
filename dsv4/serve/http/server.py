"""Starting and stopping the two processes of `dsv4 serve`.

`APIServer` binds the listening socket first (a busy port fails before any model loads),
then spawns the engine core and waits until it is ready, then runs uvicorn on that socket
in the calling thread. When the engine core dies the server stops (exit code 1); on
SIGTERM, SIGINT or `stop()` it shuts down gracefully (`shutdown.py`) and exits 0; either way
it then stops the engine core (which also exits by itself if this process dies) and
removes the IPC folder.
"""
from __future__ import annotations

import gc
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn

from ...config import EngineConfig
from .api import build_app
from ..client import EngineClient
from ...engine.core import run_engine_core
from ...engine.ipc import Ready
from .limits import ServerLimits
from .shutdown import GracefulServer
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


def listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class APIServer:
    def __init__(self, settings: ServeSettings, engine_target: Callable = run_engine_core):
        self.settings = settings
        self.sock = listen_socket(settings.host, settings.port)
        self.port = self.sock.getsockname()[1]
        if settings.disagg is not None:
            from ...disagg.serving import role_engine_target
            engine_target = role_engine_target(settings.disagg)
        self.client = EngineClient(settings.model_dir, settings.engine, engine_target)
        self.uvicorn: GracefulServer | None = None
        self.engine_died = False

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"http://{host}:{self.port}"

    def start_engine(self, timeout: float | None = None) -> Ready:
        """Spawn the engine core and wait for it; EngineStartError says why it could not start."""
        try:
            return self.client.start(timeout)
        except BaseException:
            self.close()
            raise

    def serve(self, on_ready: Callable[[], None] | None = None) -> int:
        """Run until stopped (SIGTERM, Ctrl-C, `stop()`) or the engine dies; 1 when it died."""
        s = self.settings
        try:
            state = ServerState.create(self.client, s.model_dir, s.model_names, s.api_key, s.limits,
                                       s.engine.tokenizer)
            self.client.on_death = self._engine_died
            app = build_app(state, on_ready, warm=s.disagg is None)   # a disaggregated role's request needs its peer
            if s.disagg is not None:
                from ...disagg.serving import add_disagg_routes
                add_disagg_routes(app, state, s.disagg)
            config = uvicorn.Config(app, log_level=s.log_level)
            gc.freeze()     # start-up objects (app, tokenizer) out of the full collections that run while serving
            self.uvicorn = GracefulServer(config, s.limits.shutdown_timeout, self.client.fail_all)
            self.uvicorn.run(sockets=[self.sock])
        except KeyboardInterrupt:
            pass   # a Ctrl-C before uvicorn took over the signals
        finally:
            self.close()
        return 1 if self.engine_died else 0

    def stop(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    def _engine_died(self, reason: str) -> None:
        self.engine_died = True
        print(f"dsv4 serve: {reason.split(';')[0]}; shutting down", file=sys.stderr, flush=True)
        self.stop()

    def close(self) -> None:
        self.client.close()
        self.sock.close()
