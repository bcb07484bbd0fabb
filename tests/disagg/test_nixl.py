"""The NIXL (UCX, CPU memory) read of a published state (disagg/nixl_transport.py): bytes arrive
intact, the source buffer is deregistered once the reader says done or goes away."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from dsv4.disagg.nixl_transport import NixlReader, NixlSource
from dsv4.disagg.wire import recv_frame


@pytest.fixture(scope="module")
def agents():
    return NixlSource(), NixlReader()


def publish(source, data: bytes):
    a, b = socket.socketpair()
    t = threading.Thread(target=source.serve, args=(a, {"ok": True}, data))
    t.start()
    reply, _ = recv_frame(b)
    return a, b, t, reply


@pytest.mark.parametrize("size", [1, 4096, 3 << 20])
def test_read_gets_the_bytes(agents, size):
    source, reader = agents
    data = os.urandom(size)
    a, b, t, reply = publish(source, data)
    assert reply["ok"] and reply["nixl"]["nbytes"] == size
    assert reader.read(b, reply["nixl"], time.monotonic() + 10) == data
    t.join(10)
    assert not t.is_alive()                                  # the source got "done" and deregistered
    a.close(), b.close()


def test_reader_gone_releases_the_source(agents):
    source, _ = agents
    a, b = socket.socketpair()
    errors = []

    def serve():
        try:
            source.serve(a, {"ok": True}, b"x" * 100)
        except ConnectionError as e:                       # StateServer logs it; the buffer is deregistered
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    recv_frame(b)
    b.close()                                              # the decode side died before reading
    t.join(10)
    assert not t.is_alive() and errors
    a.close()
