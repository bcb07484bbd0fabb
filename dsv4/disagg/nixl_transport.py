"""The state transport over NIXL (UCX backend): one-sided reads of the prefill engine's packed
state (docs/architecture.md, "Disaggregation").

The control exchange is the TCP one (transport.py: handshake, prompt), but the state's bytes do
not travel in the frame: the prefill side registers the packed state with its NIXL agent and
answers with its agent metadata and the serialized descriptors; the decode side registers a
receive buffer, adds the remote agent, reads (`initialize_xfer("READ", ...)`, `transfer`,
`check_xfer_state` until DONE, ERR or the timeout), then sends `done` so the prefill side
deregisters and drops its copy.
"""
from __future__ import annotations

import base64
import threading
import time
import uuid

import torch

from .wire import TransferError, recv_frame, send_frame

POLL_S = 0.0005


def load_nixl():
    """nixl's agent classes (the meta package `nixl`, or a CUDA-variant wheel directly)."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            module = __import__(name, fromlist=["nixl_agent"])
            return module.nixl_agent, module.nixl_agent_config
        except ImportError:
            continue
    raise ImportError("no NIXL package (pip install nixl-cu13 or nixl-cu12)")


def new_agent(role: str):
    agent, config = load_nixl()
    return agent(f"dsv4-{role}-{uuid.uuid4().hex[:8]}", config(backends=["UCX"]))


class NixlSource:
    """Prefill side: publish one packed state for a remote read; `serve` blocks until the
    reader says done (or goes away)."""

    def __init__(self):
        self.agent = new_agent("prefill")
        self.lock = threading.Lock()                          # agent calls from connection threads

    def serve(self, conn, reply: dict, data: bytes) -> None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(1, dtype=torch.uint8)
        with self.lock:
            reg = self.agent.register_memory(buf)
            descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(buf))
            metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()   # with this registration
        try:
            send_frame(conn, {**reply, "nixl": {"agent": metadata, "descs": base64.b64encode(descs).decode(),
                                               "nbytes": len(data)}})
            recv_frame(conn)                                  # "done" (or the connection closes)
        finally:
            with self.lock:
                self.agent.deregister_memory(reg)


class NixlReader:
    """Decode side: read a published state into a registered buffer."""

    def __init__(self):
        self.agent = new_agent("decode")
        self.lock = threading.Lock()                          # agent calls from pull threads

    def read(self, sock, nixl: dict, deadline: float) -> bytes:
        n = int(nixl["nbytes"])
        dst = torch.zeros(max(n, 1), dtype=torch.uint8)
        with self.lock:
            reg = self.agent.register_memory(dst)
        try:
            with self.lock:
                name = self.agent.add_remote_agent(base64.b64decode(nixl["agent"]))   # (re)loads its registrations
                remote = self.agent.deserialize_descs(base64.b64decode(nixl["descs"]))
                handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(dst), remote, name)
            try:
                self._wait(handle, deadline)
            finally:
                with self.lock:
                    self.agent.release_xfer_handle(handle)
            send_frame(sock, {"op": "done"})
            return dst[:n].numpy().tobytes()
        finally:
            with self.lock:
                self.agent.deregister_memory(reg)

    def _wait(self, handle, deadline: float) -> None:
        with self.lock:
            state = self.agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise TransferError("the NIXL read timed out", 504)
            time.sleep(POLL_S)
            with self.lock:
                state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise TransferError("the NIXL read failed", 502)
