"""The engine-core process of a prefill or decode engine: `run_engine_core` with the role's
core (prefill.py, decode.py) and a wake-up pipe, so that a transfer thread can end the loop's
idle wait (it pushes an empty `AbortRequests` into the engine's inbox).

The prefill engine reports its state server's address through a file in the IPC folder
(`state_address`), read by the API process for GET /disagg/info.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from ..engine.core import _load_engine, _startup_message, ready_message, serve_loop
from ..engine.ipc import AbortRequests, StartupFailed, encode, engine_sockets, parent_alive
from .settings import DisaggSettings

WAKE_ADDRESS = "inproc://dsv4-disagg-wake"


class Waker:
    """Thread-safe: one PUSH bound in-process; the engine's inbox (PULL) also connects to it."""

    def __init__(self, ctx, inbox):
        import zmq
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.bind(WAKE_ADDRESS)
        inbox.connect(WAKE_ADDRESS)
        self._lock, self._frame = threading.Lock(), encode(AbortRequests([]))

    def __call__(self) -> None:
        with self._lock:
            self._sock.send(self._frame)


def state_address_file(addresses) -> str:
    return os.path.join(addresses.folder, "state_address")


def run_role_engine_core(settings: DisaggSettings, model_dir: str, config, addresses, parent_pid: int) -> None:
    import zmq
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {settings.role}-core %(levelname)s %(message)s")
    ctx = zmq.Context()
    inbox, outbox = engine_sockets(ctx, addresses)
    try:
        engine = _load_engine(model_dir, config)
        core = _role_core(settings, engine, Waker(ctx, inbox))
        if settings.role == "prefill":
            with open(state_address_file(addresses), "w") as f:
                f.write(f"{core.server.address} {core.server.signature}")
    except BaseException as e:  # noqa: BLE001 - report anything
        outbox.send(encode(StartupFailed(_startup_message(model_dir, e))))
        outbox.close(linger=2000)
        sys.exit(1)
    outbox.send(encode(ready_message(engine)))
    try:
        serve_loop(core, inbox, outbox, parent_pid)
    finally:
        ctx.destroy(linger=0)
        if not parent_alive(parent_pid):
            addresses.remove()


def _role_core(settings: DisaggSettings, engine, wake):
    if settings.role == "prefill":
        from .prefill import PrefillCore
        return PrefillCore(engine, settings.host, settings.port, wake, _nixl("NixlSource", settings))
    from .decode import DecodeCore
    return DecodeCore(engine, settings.timeout, wake, nixl_reader=_nixl("NixlReader", settings))


def _nixl(kind: str, settings: DisaggSettings):
    if settings.transport != "nixl":
        return None
    from . import nixl_transport
    return getattr(nixl_transport, kind)()
