"""`dsv4 serve --role prefill|decode --kv-transfer JSON` (docs/architecture.md, "Disaggregation")."""
from __future__ import annotations

import json
from dataclasses import dataclass

ROLES = ("prefill", "decode")
KV_TRANSFER_HEADER = "x-dsv4-kv-transfer"     # router -> decode engine: the prefill engine's HOST:PORT
KV_TRANSFER_KEYS = {"host", "port", "timeout", "transport"}
TRANSPORTS = ("tcp", "nixl")          # nixl: the bytes move by a NIXL (UCX) read, disagg/nixl_transport.py


@dataclass(frozen=True)
class DisaggSettings:
    role: str
    host: str = "127.0.0.1"          # prefill: where its state server listens
    port: int = 0                    # 0: any free port (reported by GET /disagg/info)
    timeout: float = 30.0            # decode: seconds a transfer may take (prefill included)
    transport: str = "tcp"           # one of TRANSPORTS


def parse_kv_transfer(role: str, text: str | None) -> DisaggSettings:
    """ValueError naming the flag and the key for anything wrong."""
    if role not in ROLES:
        raise ValueError(f"--role: {role!r} is not one of {', '.join(ROLES)}")
    try:
        raw = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-transfer: expected a JSON object")
    unknown = set(raw) - KV_TRANSFER_KEYS
    if unknown:
        raise ValueError(f"--kv-transfer: unknown key(s) {sorted(unknown)}; known: {sorted(KV_TRANSFER_KEYS)}")
    s = DisaggSettings(role, **raw)
    if not isinstance(s.port, int) or not 0 <= s.port < 65536:
        raise ValueError(f"--kv-transfer: port {s.port!r} is not a TCP port")
    if not isinstance(s.timeout, (int, float)) or s.timeout <= 0:
        raise ValueError(f"--kv-transfer: timeout {s.timeout!r} must be a positive number of seconds")
    if s.transport not in TRANSPORTS:
        raise ValueError(f"--kv-transfer: transport {s.transport!r} is not one of {', '.join(TRANSPORTS)}")
    return s
