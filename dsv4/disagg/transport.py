"""Moving a request's state from a prefill engine to a decode engine (docs/architecture.md,
"Disaggregation").

`KVTransport` is what a decode engine core calls (from a worker thread): `pull` asks the prefill
engine at `address` to compute the prompt's state and returns it. The exchange starts with a
handshake: the decode side sends its state signature (disagg/state.py: model config hash with
the IndexCache producer set, dtypes, KV dtype, format version) and a readable summary; the
prefill side refuses a mismatch with both summaries in the error (no state moves).

`TcpTransport` carries the control exchange and, by default, the state's bytes in its reply
frame; with a `NixlReader` (nixl_transport.py) the bytes move by a one-sided NIXL read of the
prefill side's registered buffer instead. The prefill side is `StateServer` (prefill.py).
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Protocol

from .state import StateHeader, StateMismatch, header_from_json
from .wire import TransferError, parse_address, recv_frame, send_frame


class KVTransport(Protocol):
    def pull(self, address: str, transfer_id: str, prompt_ids: list[int], timeout: float, first_page: int = 0
             ) -> tuple[StateHeader, bytes]: ...

    def cancel(self, transfer_id: str) -> None: ...


class TcpTransport:
    """One TCP connection per transfer: hello (signature) -> prefill (tokens) -> state."""

    def __init__(self, signature: str, summary: dict, nixl_reader=None):
        self.signature, self.summary = signature, summary
        self.nixl = nixl_reader                           # NixlReader: the bytes move by a NIXL read
        self._socks: dict[str, socket.socket] = {}       # pulls in flight
        self._cancelled: set[str] = set()                 # cancelled before their connection existed
        self._lock = threading.Lock()

    def pull(self, address: str, transfer_id: str, prompt_ids: list[int], timeout: float, first_page: int = 0
             ) -> tuple[StateHeader, bytes]:
        """The state of `prompt_ids` (at their end), history pages from `first_page` on."""
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise TransferError(f"cannot reach the prefill engine at {address}: {e}", 503) from None
        with self._lock:
            if transfer_id in self._cancelled:
                self._cancelled.discard(transfer_id)
                sock.close()
                raise TransferError(f"transfer {transfer_id} cancelled", 499)
            self._socks[transfer_id] = sock
        try:
            sock.settimeout(timeout)
            send_frame(sock, {"op": "hello", "signature": self.signature, "summary": self.summary})
            reply, _ = recv_frame(sock)
            if not reply.get("ok"):
                raise StateMismatch(reply.get("error", "the prefill engine refused the handshake"))
            send_frame(sock, {"op": "prefill", "id": transfer_id, "prompt": prompt_ids, "first_page": first_page,
                              "transport": "nixl" if self.nixl is not None else "tcp"})
            reply, data = recv_frame(sock)
            if not reply.get("ok"):
                raise TransferError(f"the prefill engine at {address} failed the request: {reply.get('error')}",
                                    int(reply.get("status", 502)))
            if self.nixl is not None:
                data = self.nixl.read(sock, reply["nixl"], time.monotonic() + timeout)
            return header_from_json(reply["state"]), data
        except socket.timeout:
            raise TransferError(f"the transfer from {address} timed out after {timeout:g} s", 504) from None
        except (ConnectionError, OSError) as e:
            raise TransferError(f"lost the prefill engine at {address} during the transfer: {e}", 502) from None
        finally:
            with self._lock:
                self._socks.pop(transfer_id, None)
            sock.close()

    def cancel(self, transfer_id: str) -> None:
        """Abort a pull in flight (from another thread): the prefill side sees the connection close."""
        with self._lock:
            sock = self._socks.pop(transfer_id, None)
            if sock is None:
                self._cancelled.add(transfer_id)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
