"""The prefill role's engine core (docs/architecture.md, "Disaggregation").

`StateServer` listens for decode engines (one thread per connection): handshake (the layout
signature, refused on a mismatch), then a prompt to prefill; it queues the prompt for the engine
loop, waits for the exported state and sends it. When the decode side goes away before that
(abort, crash, timeout), the prefill request is aborted and its bytes dropped.

`PrefillCore` is `EngineCore` plus: each loop takes the queued prompts (engine request
`pd-<transfer id>`, prompt[:-1], max_tokens 1, marked for export) and hands finished exports
to their waiting connection. Its pages are released when the request finishes (handoff.py).
"""
from __future__ import annotations

import logging
import queue
import select
import socket
import threading

from ..engine.core import EngineCore
from ..sampling_params import SamplingParams
from .handoff import Exporter
from .state import header_to_json, signature_summary
from .wire import recv_frame, send_frame

log = logging.getLogger("dsv4.disagg.prefill")
POLL_S = 0.05        # how often a waiting connection checks that its decode side is still there


class _Waiting:
    def __init__(self, transfer_id: str, prompt: list[int], first_page: int = 0):
        self.id, self.prompt, self.first_page = transfer_id, prompt, first_page
        self.done = threading.Event()
        self.result: tuple | None = None          # (header, bytes) or (status, message)
        self.ok = False


class StateServer:
    def __init__(self, host: str, port: int, signature: str, summary: dict, wake, nixl=None):
        self.signature, self.summary, self.wake = signature, summary, wake
        self.nixl = nixl                                  # NixlSource: serves NIXL reads too
        self.inbox: queue.Queue = queue.Queue()           # ("prefill", _Waiting) | ("abort", id)
        self.sent = self.bytes_sent = self.failures = 0   # states sent; transfers the decode side left
        self.sock = socket.create_server((host, port))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, name="dsv4-state-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                hello, _ = recv_frame(conn)
                if hello.get("signature") != self.signature:
                    send_frame(conn, {"ok": False, "error": (
                        f"KV layout mismatch: the decode engine has {hello.get('summary')} "
                        f"(signature {str(hello.get('signature'))[:16]}...), this prefill engine has "
                        f"{self.summary} (signature {self.signature[:16]}...)")})
                    return
                send_frame(conn, {"ok": True})
                ask, _ = recv_frame(conn)
                waiting = _Waiting(str(ask["id"]), [int(t) for t in ask["prompt"]], int(ask.get("first_page", 0)))
                if ask.get("transport", "tcp") == "nixl" and self.nixl is None:
                    send_frame(conn, {"ok": False, "status": 502, "error": "this prefill engine has no NIXL "
                                      "transport (--kv-transfer '{\"transport\": \"nixl\"}')"})
                    return
                via_nixl = ask.get("transport") == "nixl"
            except (OSError, ConnectionError, ValueError, KeyError, TypeError) as e:
                log.warning("dropped a transfer connection: %s", e)
                return
            self.inbox.put(("prefill", waiting))
            self.wake()
            if not self._wait(conn, waiting):
                self.failures += 1
                self.inbox.put(("abort", waiting.id))
                self.wake()
                return
            try:
                if waiting.ok:
                    header, data = waiting.result
                    reply = {"ok": True, "state": header_to_json(header)}
                    if via_nixl:
                        self.nixl.serve(conn, reply, data)
                    else:
                        send_frame(conn, reply, data)
                    self.sent, self.bytes_sent = self.sent + 1, self.bytes_sent + len(data)
                else:
                    status, message = waiting.result
                    send_frame(conn, {"ok": False, "status": status, "error": message})
            except OSError as e:
                self.failures += 1
                log.warning("transfer %s: the decode side went away while sending: %s", waiting.id, e)

    @staticmethod
    def _wait(conn: socket.socket, waiting: _Waiting) -> bool:
        """Wait for the export; False when the decode side closed the connection first."""
        while not waiting.done.wait(POLL_S):
            readable, _, _ = select.select([conn], [], [], 0)
            if readable and not conn.recv(1, socket.MSG_PEEK):
                return False
        return True


class PrefillCore(EngineCore):
    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, wake=lambda: None, nixl=None):
        super().__init__(engine)
        self.exporter = Exporter(engine)
        storage = engine.runner.storage
        dtype = storage.kinds["swa"].dtype
        self.server = StateServer(host, port, self.exporter.codec.signature,
                                  signature_summary(engine.layout, dtype), wake, nixl)
        self.waiting: dict[str, _Waiting] = {}            # engine request id -> its connection

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished() or not self.server.inbox.empty()

    def step(self):
        self._take_transfers()
        outs = super().step() if self.engine.has_unfinished() else []
        self._hand_over()
        return outs

    def _take_transfers(self) -> None:
        while True:
            try:
                what, item = self.server.inbox.get_nowait()
            except queue.Empty:
                return
            if what == "abort":
                rid = f"pd-{item}"
                self.engine.abort(rid)
                self.exporter.wanted.pop(rid, None)
                self.exporter.ready.pop(rid, None)
                self.waiting.pop(rid, None)
                continue
            self._start(item)

    def _start(self, w: _Waiting) -> None:
        rid = f"pd-{w.id}"
        try:
            self.engine.add_request(rid, w.prompt, SamplingParams(max_tokens=1, temperature=0))
        except ValueError as e:
            w.result, w.ok = (400, str(e)), False
            w.done.set()
            return
        self.exporter.wanted[rid] = w.first_page
        self.waiting[rid] = w

    def _hand_over(self) -> None:
        for rid in list(self.exporter.ready):
            state = self.exporter.ready.pop(rid)
            w = self.waiting.pop(rid, None)
            if w is not None:
                w.result, w.ok = state, True
                w.done.set()
        for rid, w in list(self.waiting.items()):       # failed inside a step (EngineCore aborted it)
            if rid not in self.engine.requests and rid not in self.exporter.ready:
                self.waiting.pop(rid)
                w.result, w.ok = (500, "the prefill step failed"), False
                w.done.set()

    def stats(self):
        s = super().stats()
        s.kv_transfers_pending = len(self.waiting)
        srv = self.server
        s.kv_transfers, s.kv_transfer_bytes, s.kv_transfer_failures = srv.sent, srv.bytes_sent, srv.failures
        return s
