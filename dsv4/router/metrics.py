"""The router's Prometheus text: its own counters, and per engine (labels url, role) the
router's requests in flight, the engine's running / waiting queues and, for decode engines,
transfer count, bytes, seconds and failures (from each engine's GET /disagg/info)."""
from __future__ import annotations

ENGINE_FIELDS = ("num_running", "num_waiting", "pages_used", "kv_transfers", "kv_transfer_bytes",
                 "kv_transfer_seconds", "kv_transfer_failures", "kv_transfers_pending")


class RouterMetrics:
    def __init__(self):
        self.requests = self.retries = self.failures = 0
        self.first_byte_seconds = 0.0           # sum over requests: arrival -> decode engine's headers

    def observe_first(self, seconds: float) -> None:
        self.first_byte_seconds += seconds

    def render(self, backends, infos: dict) -> str:
        lines = [f"dsv4_router:requests_total {self.requests}", f"dsv4_router:retries_total {self.retries}",
                 f"dsv4_router:failures_total {self.failures}",
                 f"dsv4_router:time_to_first_byte_seconds_sum {self.first_byte_seconds:.6f}"]
        for b in backends:
            label = f'{{url="{b.url}",role="{b.role}"}}'
            lines += [f"dsv4_router:in_flight{label} {b.in_flight}", f"dsv4_router:backend_up{label} {int(b.up)}",
                      f"dsv4_router:backend_failures_total{label} {b.failures}"]
            info = infos.get(b.url)
            for name in ENGINE_FIELDS if info else ():
                lines.append(f"dsv4_engine:{name}{label} {info.get(name, 0)}")
        return "\n".join(lines) + "\n"
