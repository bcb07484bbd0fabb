"""The decode role's engine core (docs/architecture.md, "Disaggregation").

An `AddRequest` naming a prefill engine (`kv_transfer`: its state server's HOST:PORT) is
parked (handoff.Importer): its pages are reserved first (waiting while they are short), then a
worker thread pulls the state (transport.py); the engine loop installs it and the request runs
from the prompt's last token (a one-token prompt, or one asking for prompt logprobs, is computed
here instead). A failed pull fails the request alone (502 lost / 503
unreachable / 504 timed out / 502 layout mismatch) and releases its reservation; an abort
during the pull cancels it (the prefill side drops its work). Transfer metrics go out with
the engine stats.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

from ..engine.core import EngineCore
from ..engine.ipc import AbortRequests, AddRequest, RequestFailed
from .handoff import Importer
from .state import StateMismatch, signature_summary
from .transport import TcpTransport
from .wire import TransferError

log = logging.getLogger("dsv4.disagg.decode")


class DecodeCore(EngineCore):
    def __init__(self, engine, timeout: float = 30.0, wake=lambda: None, transport=None, nixl_reader=None):
        super().__init__(engine)
        self.importer = Importer(engine)
        dtype = engine.runner.storage.kinds["swa"].dtype
        self.transport = transport or TcpTransport(self.importer.codec.signature,
                                                   signature_summary(engine.layout, dtype), nixl_reader)
        self.timeout, self.wake = timeout, wake
        self.to_reserve: list[tuple[object, str]] = []       # (request, prefill address), arrival order
        self.pulling: dict[str, tuple[str, float]] = {}     # request id -> (transfer id, start time)
        self.done: queue.Queue = queue.Queue()               # (request id, header, bytes | TransferError)
        self.transfers = self.transfer_bytes = self.transfer_failures = 0
        self.transfer_seconds = 0.0

    # ---- inputs ------------------------------------------------------------------------
    def handle(self, message) -> None:
        if isinstance(message, AddRequest) and message.kv_transfer and len(message.prompt_token_ids) > 1 \
                and message.params.prompt_logprobs is None:      # (prompt logprobs need every prompt row here)
            self._park(message)
            return
        if isinstance(message, AbortRequests):
            for rid in message.request_ids:
                self._cancel(rid)
        super().handle(message)

    def _park(self, m: AddRequest) -> None:
        try:
            req = self.importer.begin(m.request_id, m.prompt_token_ids, m.params)
        except ValueError as e:
            self._failures.append(RequestFailed(m.request_id, 400, str(e)))
            return
        self._sent[m.request_id] = 0
        self.to_reserve.append((req, m.kv_transfer))

    def _cancel(self, rid: str) -> None:
        self.to_reserve = [(r, a) for r, a in self.to_reserve if r.request_id != rid]
        pulling = self.pulling.pop(rid, None)
        if pulling is not None:
            self.transport.cancel(pulling[0])
        self.importer.drop(rid)

    # ---- the loop ----------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished() or not self.done.empty() or bool(self.to_reserve)

    def step(self):
        self._start_pulls()
        self._install_pulled()
        if self.engine.has_unfinished():
            return super().step()
        if self.to_reserve or self.pulling:
            time.sleep(0.001)                # idle but for transfers: don't spin the core flat out
        return []

    def _start_pulls(self) -> None:
        waiting = []
        for req, address in self.to_reserve:
            first = None if waiting else self.importer.reserve(req)
            if first is None:
                waiting.append((req, address))       # first come, first reserved
                continue
            tid = uuid.uuid4().hex
            self.pulling[req.request_id] = (tid, time.monotonic())
            threading.Thread(target=self._pull, args=(req.request_id, address, tid, req.prompt_token_ids[:-1], first),
                             daemon=True).start()
        if waiting and not self.engine.has_unfinished() and not self.pulling:
            for req, _ in waiting:                   # nothing will ever free pages: fail now
                self._fail(req.request_id, 503, "the decode engine has no room for the request's state")
            waiting = []
        self.to_reserve = waiting

    def _pull(self, rid: str, address: str, tid: str, prompt: list[int], first_page: int) -> None:
        try:
            header, data = self.transport.pull(address, tid, prompt, self.timeout, first_page)
            self.done.put((rid, header, data))
        except (TransferError, StateMismatch) as e:
            self.done.put((rid, None, e))
        except Exception as e:  # noqa: BLE001 - whatever it was, it fails this request only
            log.exception("transfer %s failed", tid)
            self.done.put((rid, None, TransferError(f"{type(e).__name__}: {e}", 500)))
        self.wake()

    def _install_pulled(self) -> None:
        while True:
            try:
                rid, header, data = self.done.get_nowait()
            except queue.Empty:
                return
            pulling = self.pulling.pop(rid, None)
            req = self.importer.held.get(rid)
            if pulling is None or req is None:
                continue                                  # aborted meanwhile: already released
            if header is None:
                status = data.status if isinstance(data, TransferError) else 502
                self._fail(rid, status, str(data))
                continue
            try:
                self.importer.finish(req, header, data)
            except StateMismatch as e:
                self._fail(rid, 502, str(e))
                continue
            self.transfers += 1
            self.transfer_bytes += len(data)
            self.transfer_seconds += time.monotonic() - pulling[1]

    def _fail(self, rid: str, status: int, message: str) -> None:
        log.warning("request %s: %s", rid, message)
        self.importer.drop(rid)
        self._sent.pop(rid, None)
        self.transfer_failures += 1
        self._failures.append(RequestFailed(rid, status, message))

    def stats(self):
        s = super().stats()
        s.kv_transfers, s.kv_transfer_bytes = self.transfers, self.transfer_bytes
        s.kv_transfer_seconds, s.kv_transfer_failures = self.transfer_seconds, self.transfer_failures
        s.kv_transfers_pending = len(self.pulling) + len(self.to_reserve)
        return s
