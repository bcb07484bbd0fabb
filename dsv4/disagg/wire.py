"""Frames of the state transport over a stream socket: a JSON header and an optional payload.

frame = u32 header length | header (JSON object) | u64 payload length | payload bytes
"""
from __future__ import annotations

import json
import socket
import struct


class TransferError(RuntimeError):
    """A transfer that did not complete; `status` is the HTTP status the request fails with."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


def send_frame(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(struct.pack("!I", len(head)) + head + struct.pack("!Q", len(payload)))
    if payload:
        sock.sendall(payload)


def recv_frame(sock: socket.socket) -> tuple[dict, bytes]:
    (n,) = struct.unpack("!I", _exact(sock, 4))
    header = json.loads(_exact(sock, n))
    (m,) = struct.unpack("!Q", _exact(sock, 8))
    return header, _exact(sock, m) if m else b""


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection ({got} of {n} bytes read)")
        got += k
    return bytes(buf)


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"kv transfer address {address!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)
