"""What `dsv4 serve --role` adds to the server: the role's engine-core entry and GET /disagg/info
(role, the prefill state server's address, queue lengths, transfer metrics) that the router
reads."""
from __future__ import annotations

import functools
import os

from .entry import run_role_engine_core, state_address_file
from .settings import DisaggSettings


def role_engine_target(settings: DisaggSettings):
    return functools.partial(run_role_engine_core, settings)


def add_disagg_routes(app, state, settings: DisaggSettings) -> None:
    client = state.client

    @app.get("/disagg/info")
    async def disagg_info() -> dict:
        s = client.stats
        info = {"role": settings.role, "num_running": s.num_running, "num_waiting": s.num_waiting,
                "pages_used": s.pages_used, "pages_free": s.pages_free, "swa_pages_used": s.swa_pages_used,
                "slots_used": s.slots_used, "kv_transfers": s.kv_transfers, "kv_transfer_bytes": s.kv_transfer_bytes,
                "kv_transfer_seconds": s.kv_transfer_seconds, "kv_transfer_failures": s.kv_transfer_failures,
                "kv_transfers_pending": s.kv_transfers_pending}
        if settings.role == "prefill":
            path = state_address_file(client.addresses)
            address, _, signature = open(path).read().partition(" ") if os.path.exists(path) else (None, "", "")
            info["state_address"], info["state_signature"] = address, signature.strip() or None
        return info
